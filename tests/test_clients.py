"""Popular third-party clients against a real redserve: LangChain, instructor and guidellm.

Users reach an OpenAI-compatible server through libraries more often than through raw HTTP,
and each library reads the protocol its own way: LangChain rebuilds tool calls, finish reasons
and usage from replies and from streamed deltas into its message types; instructor leans on
`response_format` or a forced tool call and validates the result with pydantic; guidellm counts
tokens from the usage a reply (or a stream's chunks) carries. A field redserve gets subtly
wrong surfaces here as a library error even where redserve's own protocol tests pass. One
`redserve up` (the command a user runs) against the test Redis serves the whole module, with
the real SmolLM2; greedy decoding and bounded schemas keep the small model's answers short.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import instructor
import openai
import pytest
import redis
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.messages.ai import add_ai_message_chunks
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, SecretStr

from ops.embedded_redis import free_port
from shared.models import ModelInfo
from tests.stack import child_env, real_kv

pytestmark = pytest.mark.smollm2

MODEL = "smol"
KEY = SecretStr("unused")  # `up` on a loopback address serves without keys


@pytest.fixture(scope="module")
def up(redis_url: str, sync_redis: redis.Redis, smollm2: ModelInfo) -> Iterator[str]:
    """`redserve up` (one replica, one worker) on the test Redis; yields its /v1 URL."""
    port, prefix = free_port(), f"rsclients-{uuid.uuid4().hex[:8]}"
    log = Path(tempfile.mkstemp(prefix="redserve-clients-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--model",
             str(smollm2.path), "--served-model-name", MODEL, "--dtype", "float32"],
            env=child_env(redis_url, prefix, **real_kv()), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"redserve up exited:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"never ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        yield f"{base}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.unlink(missing_ok=True)
        keys = list(sync_redis.scan_iter(match=f"{prefix}:*"))
        if keys:
            sync_redis.delete(*keys)


def _merged(chunks: list[Any]) -> AIMessageChunk:
    """A stream's chunks added up as LangChain does: one message."""
    assert len(chunks) > 1 and all(isinstance(c, AIMessageChunk) for c in chunks)
    return add_ai_message_chunks(chunks[0], *chunks[1:])


def _chat(url: str, **kwargs: Any) -> ChatOpenAI:
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 24, **kwargs}
    return ChatOpenAI(base_url=url, api_key=KEY, model=MODEL, max_retries=0, timeout=120,
                      **settings)


# --- LangChain -------------------------------------------------------------------------------


def test_langchain_invoke_and_stream(up: str) -> None:
    reply = _chat(up).invoke("Name three colours.")
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    meta, usage = reply.response_metadata, reply.usage_metadata
    assert meta["model_name"] == MODEL and meta["finish_reason"] in ("stop", "length")
    assert usage is not None and usage["input_tokens"] > 0
    assert 0 < usage["output_tokens"] <= 24
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if meta["finish_reason"] == "length":
        assert usage["output_tokens"] == 24

    # stream_usage asks for stream_options.include_usage: the last chunk carries the usage.
    chunks = list(_chat(up, stream_usage=True).stream("Count from one to ten."))
    texts = [c.content for c in chunks if c.content]
    merged = _merged(chunks)
    assert isinstance(merged.content, str) and merged.content == "".join(map(str, texts))
    assert merged.response_metadata["finish_reason"] in ("stop", "length")
    assert merged.usage_metadata is not None
    # Several deltas, none empty, and never more of them than generated tokens.
    assert 1 < len(texts) <= merged.usage_metadata["output_tokens"] <= 24


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


def test_langchain_structured_output_is_a_model_instance(up: str) -> None:
    structured = _chat(up, max_tokens=80).with_structured_output(
        City, method="json_schema", include_raw=True)
    out = structured.invoke("Describe Paris as JSON.")
    assert isinstance(out, dict) and out["parsing_error"] is None
    assert isinstance(out["parsed"], City)
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    assert City.model_validate_json(out["raw"].content) == out["parsed"]


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"22 C and sunny in {city}"


def test_langchain_forced_tool_call_and_tool_message_round_trip(
    up: str, smollm2: ModelInfo
) -> None:
    from transformers import AutoTokenizer

    chat = _chat(up, max_tokens=60)
    asked = "What is the weather in Paris?"
    question = HumanMessage(asked)
    call = chat.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert isinstance(call, AIMessage)
    assert call.response_metadata["finish_reason"] == "tool_calls"
    assert not call.invalid_tool_calls and len(call.tool_calls) == 1
    tool_call = call.tool_calls[0]
    assert tool_call["name"] == "get_weather" and tool_call["id"]
    assert set(tool_call["args"]) == {"city"} and isinstance(tool_call["args"]["city"], str)

    result = get_weather.invoke(tool_call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == tool_call["id"]
    final = chat.bind_tools([get_weather], tool_choice="none").invoke([question, call, result])
    assert isinstance(final, AIMessage) and isinstance(final.content, str) and final.content
    assert not final.tool_calls
    assert final.response_metadata["finish_reason"] in ("stop", "length")
    # The assistant's call and the tool's result went into the prompt: it is longer than the
    # question alone (tool_choice none hides the tool definitions) by more than the result.
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    alone = tokenizer.apply_chat_template([{"role": "user", "content": asked}],
                                          add_generation_prompt=True, tokenize=False)
    added = len(tokenizer(str(result.content), add_special_tokens=False)["input_ids"])
    assert final.usage_metadata is not None
    assert final.usage_metadata["input_tokens"] > len(
        tokenizer(alone, add_special_tokens=False)["input_ids"]) + added


class Search(BaseModel):
    """Search the web."""

    query: str = Field(max_length=60, description="what to search for")
    max_results: int = Field(ge=1, le=10)


def test_langchain_streams_a_tool_call_for_a_pydantic_schema(up: str) -> None:
    chat = _chat(up, max_tokens=60).bind_tools([Search], tool_choice="Search")
    merged = _merged(list(chat.stream("Find three articles about Redis streams.")))
    assert merged.response_metadata["finish_reason"] == "tool_calls"
    assert not merged.invalid_tool_calls and len(merged.tool_calls) == 1
    assert merged.tool_calls[0]["name"] == "Search"
    assert isinstance(Search.model_validate(merged.tool_calls[0]["args"]), Search)


# --- instructor ------------------------------------------------------------------------------


class Species(enum.StrEnum):
    CAT = "cat"
    DOG = "dog"
    BIRD = "bird"


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Species
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(max_length=30)
    pets: list[Pet] = Field(min_length=1, max_length=3)


OWNER_PROMPT = "Alice has a cat named Tom, 3 years old, and a dog named Rex, 5 years old."

@pytest.mark.parametrize("mode", [
    instructor.Mode.JSON_SCHEMA,
    instructor.Mode.TOOLS,
])
def test_instructor_nested_model_with_enum_and_list(up: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=up, api_key="unused",
                                                  max_retries=0), mode=mode)
    owner, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Owner, max_retries=0, max_tokens=150, temperature=0,
        messages=[{"role": "user", "content": OWNER_PROMPT}])
    assert isinstance(owner, Owner) and 1 <= len(owner.pets) <= 3
    assert all(isinstance(p, Pet) and isinstance(p.species, Species) for p in owner.pets)
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")


class Task(BaseModel):
    title: str = Field(max_length=40)
    priority: Literal["low", "medium", "high"]
    tags: list[str] = Field(min_length=1, max_length=3)


def test_instructor_tools_mode_returns_a_validated_model(up: str) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=up, api_key="unused",
                                                  max_retries=0), mode=instructor.Mode.TOOLS)
    task, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Task, max_retries=0, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Create a high priority task to fix the login "
                                              "bug, tagged backend and auth."}])
    assert isinstance(task, Task) and task.priority in ("low", "medium", "high")
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    sent = Task.model_validate_json(choice.message.tool_calls[0].function.arguments)
    assert sent.model_dump() == task.model_dump()


# --- guidellm --------------------------------------------------------------------------------

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 32, 16, 4


def _chat_template_tokens(tokenizer: Any, request_args: str) -> int:
    """What the server counts for guidellm's request: its messages through the chat template."""
    messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else "".join(part["text"] for part in m["content"])}
                for m in json.loads(request_args)["body"]["messages"]]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(("stream", "profile"), [
    (True, "kind=concurrent,streams=2"),
    (False, "kind=synchronous"),
])
def test_guidellm_benchmark_reads_redserves_usage(
    up: str, smollm2: ModelInfo, tmp_path: Path, stream: bool, profile: str
) -> None:
    from transformers import AutoTokenizer

    guidellm = Path(sys.executable).parent / "guidellm"
    if not guidellm.exists():
        pytest.fail("guidellm is not installed: `make setup` (or pip install --no-deps "
                    "guidellm==0.8.1; see the Makefile)")
    report = tmp_path / "report.json"
    backend = f"kind=openai_http,target={up},model={MODEL},stream={str(stream).lower()}"
    run = subprocess.run(
        [str(guidellm), "run", "--backend", backend, "--profile", profile,
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--tokenizer", f"kind=huggingface_auto,model={smollm2.path}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                   f"output_tokens={OUTPUT_TOKENS}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        cwd=tmp_path, capture_output=True, text=True, timeout=150,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    # Every request guidellm made succeeded (its scheduler's count of them all) ... Its
    # scheduler stops at the constraint as its own state counts (created, then processed,
    # across its processes): a loaded machine once saw it make 3 of 4, all successful.
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == made["incomplete"] == 0, made
    assert made["successful"] == made["total"] >= REQUESTS - 1, made
    # ... and those it measured read redserve's usage right. Its measured totals are windowed
    # (from the first request's start to the completion that met the constraint): in one CI
    # run with two streams they held 3 of 4, none errored or incomplete (not seen here since).
    totals, done = bench["metrics"]["request_totals"], bench["requests"]["successful"]
    assert totals["errored"] == totals["incomplete"] == 0, totals
    assert totals["successful"] == totals["total"] == len(done) >= REQUESTS - 1, totals

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    for r in done:
        assert r["response_id"].startswith("chatcmpl-") and r["output"]
        # guidellm asks for ignore_eos, so every reply is exactly as long as asked; the count
        # is the usage redserve reported (without usage guidellm leaves it unset).
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        # The prompt count is the server's too: the chat template's tokens, not guidellm's own
        # count of the raw prompt.
        assert r["input_metrics"]["text_tokens"] == _chat_template_tokens(
            tokenizer, r["request_args"]) > PROMPT_TOKENS
        timings = r["info"]["timings"]
        if stream:
            assert timings["token_iterations"] > 1 and timings["first_token_iteration"]
        else:
            assert timings["token_iterations"] == 0
