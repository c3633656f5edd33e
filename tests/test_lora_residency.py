"""LoRA adapters loaded on demand (worker/engine/lora/resident.py), in the engine, against peft:
a worker holding two adapters at once serves four, each request's text that of its adapter's
merged model alone (also when an adapter is laid out over several step boundaries); the
least recently used adapter is the one evicted; a request whose
adapter finds every slot named by running requests waits for one and then completes; an
adapter that fails its checks ends its own requests only, with the problem named.

No adapter is declared to these engines: each request carries where its adapter lives
(`GenerateRequest.lora_path`), as a replica sets it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from shared.messages import GenerateRequest, SamplingParams
from shared.models import ModelInfo
from shared.settings import WorkerSettings
from tests.lora_adapters import ALL, greedy, make_adapter, merged, tiny_base
from worker.engine.build import attach_loras
from worker.engine.checkpoint import Checkpoint
from worker.engine.engine import Engine, EngineConfig, StepOutput
from worker.engine.kv_cache import KVPool
from worker.engine.lora import resident
from worker.engine.lora.resident import Residency
from worker.engine.model_runner import ModelRunner

PAGE_SIZE = 4
NAMES = ["a", "b", "c", "d"]
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 30)), [7, 8]]
NEW = 10
LONG = 40  # tokens of a request that keeps its adapter busy


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """The tiny Llama, and its directory (an adapter is checked against its config.json)."""
    path = tmp_path_factory.mktemp("lora-residency-base")
    return tiny_base(path), path


@pytest.fixture(scope="module")
def adapters(base: tuple[PreTrainedModel, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    targets = [ALL, ["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["o_proj", "up_proj"]]
    return {name: make_adapter(base[0], root / name, t, seed=i + 1)
            for i, (name, t) in enumerate(zip(NAMES, targets, strict=True))}


@pytest.fixture(scope="module")
def models(base: tuple[PreTrainedModel, Path],
           adapters: dict[str, Path]) -> dict[str, PreTrainedModel]:
    """peft's merged model of each adapter ("" for the base model)."""
    return {"": base[0], **{name: merged(base[0], path) for name, path in adapters.items()}}


def _engine(base: tuple[PreTrainedModel, Path], max_loras: int = 2) -> Engine:
    model, path = base
    runner = ModelRunner(Checkpoint.of(model), kernels="torch", page_size=PAGE_SIZE)
    info = ModelInfo("m", path, model.config.max_position_embeddings, ())
    loras = attach_loras(runner, info, WorkerSettings(max_loras=max_loras))
    config = EngineConfig(max_running=16, max_step_tokens=64,
                          max_model_len=model.config.max_position_embeddings,
                          page_size=PAGE_SIZE, loras=loras)
    return Engine(runner, KVPool(runner.kv_shape, 256, PAGE_SIZE), config, eos_token_ids=())


def _residency(engine: Engine) -> Residency:
    assert engine.config.loras is not None
    return engine.config.loras


def _request(rid: str, prompt: list[int], lora: str = "", path: Path | str = "",
             max_tokens: int = NEW) -> GenerateRequest:
    return GenerateRequest(id=rid, model="m", prompt_ids=tuple(prompt), created=0.0,
                           queue_deadline=0.0, deadline=0.0, lora=lora, lora_path=str(path),
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _run(engine: Engine, joins: dict[int, list[GenerateRequest]]) -> list[list[StepOutput]]:
    """Step until idle, adding `joins[step]` before that step: each step's outputs."""
    steps: list[list[StepOutput]] = []
    while engine.scheduler.has_work() or any(s >= len(steps) for s in joins):
        for req in joins.get(len(steps), []):
            engine.add(req)
        steps.append(engine.step())
    engine.scheduler.pages.check()
    return steps


def _tokens(steps: list[list[StepOutput]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for outputs in steps:
        for o in outputs:
            assert o.error is None, o
            assert o.token is not None
            tokens.setdefault(o.request_id, []).append(o.token)
    return tokens


@pytest.mark.parametrize("budget", [resident.LAY_OUT_BUDGET_S, 0.0])
def test_two_slots_serve_four_adapters_each_request_as_its_adapter_alone(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        models: dict[str, PreTrainedModel], budget: float,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Budget 0: one linear laid out per step boundary, steps of the other adapters between
    (an evicted adapter's slot reused while its linears are laid out again)."""
    monkeypatch.setattr(resident, "LAY_OUT_BUDGET_S", budget)
    engine = _engine(base)
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ["", *NAMES]]
    joins: dict[int, list[GenerateRequest]] = {}
    for j, (name, i) in enumerate(jobs):
        joins.setdefault(j % 4, []).append(
            _request(f"r-{j}", PROMPTS[i], name, adapters[name] if name else ""))
    tokens = _tokens(_run(engine, joins))
    for j, (name, i) in enumerate(jobs):
        assert tokens[f"r-{j}"] == greedy(models[name], PROMPTS[i], NEW), (name, i)
    residency = _residency(engine)
    assert len(residency.resident) == 2
    assert set(residency.loads) == set(NAMES) and sum(residency.evictions.values()) >= 2


def test_the_least_recently_used_adapter_is_evicted(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        models: dict[str, PreTrainedModel]) -> None:
    engine = _engine(base)
    residency = _residency(engine)
    for j, name in enumerate(["a", "b", "a", "c"]):  # a used again after b: b is the LRU
        tokens = _tokens(_run(engine, {0: [_request(f"r-{j}", PROMPTS[0], name,
                                                     adapters[name])]}))
        assert tokens[f"r-{j}"] == greedy(models[name], PROMPTS[0], NEW), name
    assert residency.resident == ("a", "c")
    assert dict(residency.evictions) == {"b": 1}
    assert dict(residency.loads) == {"a": 1, "b": 1, "c": 1}
    _tokens(_run(engine, {0: [_request("r-4", PROMPTS[0], "d", adapters["d"])]}))
    assert residency.resident == ("c", "d") and dict(residency.evictions) == {"a": 1, "b": 1}


def test_a_request_waits_for_a_slot_while_every_resident_adapter_is_busy(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        models: dict[str, PreTrainedModel]) -> None:
    """a and b run long; c is read meanwhile, waits in the queue (not refused) until a's
    request ends and frees its slot, then runs and decodes as c alone."""
    engine = _engine(base)
    steps = _run(engine, {
        0: [_request("long-a", PROMPTS[1], "a", adapters["a"], LONG),
            _request("short-b", PROMPTS[1], "b", adapters["b"], LONG + 5)],
        3: [_request("c", PROMPTS[0], "c", adapters["c"])]})
    first = {}
    last = {}
    for n, outputs in enumerate(steps):
        for o in outputs:
            first.setdefault(o.request_id, n)
            last[o.request_id] = n
    assert first["c"] > last["long-a"]  # a's slot freed first: b's request ran on
    assert first["c"] <= last["short-b"]
    tokens = _tokens(steps)
    assert tokens["c"] == greedy(models["c"], PROMPTS[0], NEW)
    assert tokens["long-a"] == greedy(models["a"], PROMPTS[1], LONG)
    assert dict(_residency(engine).evictions) == {"a": 1}


def test_a_bad_adapter_ends_its_own_requests_only(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        models: dict[str, PreTrainedModel], tmp_path: Path) -> None:
    wide = make_adapter(base[0], tmp_path / "wide", ["q_proj"], rank=32)
    engine = _engine(base)
    steps = _run(engine, {0: [_request("good", PROMPTS[1], "a", adapters["a"]),
                              _request("missing", PROMPTS[0], "x", tmp_path / "nowhere"),
                              _request("wide", PROMPTS[0], "wide", wide),
                              _request("plain", PROMPTS[2])]})
    errors = {o.request_id: o.error for outputs in steps for o in outputs if o.error}
    assert set(errors) == {"missing", "wide"}
    assert "missing file adapter_config.json" in errors["missing"].message
    assert "rank 32 is over --max-lora-rank 16" in errors["wide"].message
    assert errors["wide"].code == "invalid_lora_adapter"
    tokens = _tokens([[o for o in outputs if o.error is None] for outputs in steps])
    assert tokens["good"] == greedy(models["a"], PROMPTS[1], NEW)
    assert tokens["plain"] == greedy(models[""], PROMPTS[2], NEW)
    assert _residency(engine).resident == ("a",)


def test_a_request_arriving_while_its_adapter_is_laid_out_waits_for_that_load(
        base: tuple[PreTrainedModel, Path], adapters: dict[str, Path],
        models: dict[str, PreTrainedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """One linear laid out per step boundary, a base request keeping the steps going: a
    second request for the adapter joins mid-layout and is served by the same load."""
    monkeypatch.setattr(resident, "LAY_OUT_BUDGET_S", 0.0)
    engine = _engine(base)
    residency = _residency(engine)
    engine.add(_request("base", PROMPTS[1], max_tokens=LONG))
    engine.add(_request("first", PROMPTS[0], "a", adapters["a"]))
    steps = [engine.step()]
    while residency.loading and not residency.holds("a") and residency._job is None:
        steps.append(engine.step())
    assert residency._job is not None  # a's layout has begun, not ended
    engine.add(_request("second", PROMPTS[2], "a", adapters["a"]))
    steps += _run(engine, {})
    tokens = _tokens(steps)
    assert tokens["first"] == greedy(models["a"], PROMPTS[0], NEW)
    assert tokens["second"] == greedy(models["a"], PROMPTS[2], NEW)
    assert dict(residency.loads) == {"a": 1}

