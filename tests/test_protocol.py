"""OpenAI conformance, driven by the official client (sync and async) against the real stack,
plus raw-HTTP checks of the SSE framing."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from transformers import AutoTokenizer

from shared.keys import Keys
from shared.messages import GenerateRequest
from tests.stack import Stack, eventually

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_model))


def _msg(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_n_choices_are_indexed_and_counted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=_msg("hi"), n=3,  # type: ignore[arg-type]
                                           max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 18  # 3 x 6 (a random model rarely says EOS)
    texts = {c.message.content for c in reply.choices}
    assert len(texts) > 1  # each choice sampled on its own
    again = client.chat.completions.create(model=MODEL, messages=_msg("hi"), n=3,  # type: ignore[arg-type]
                                           max_tokens=6, temperature=1.0, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


async def test_streamed_choices_each_get_role_content_and_finish(
    aclient: openai.AsyncOpenAI,
) -> None:
    whole = await aclient.chat.completions.create(model=MODEL, messages=_msg("hey"), n=2,  # type: ignore[arg-type]
                                                  max_tokens=8, temperature=0)
    texts = {0: "", 1: ""}
    roles, finishes = set(), {}
    async for chunk in await aclient.chat.completions.create(
        model=MODEL, messages=_msg("hey"), n=2, max_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
    ):
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0, 1} and set(finishes) == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_completions_prompt_forms(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    a, b = "The sea is", "Mountains are"
    by_text = client.completions.create(model=MODEL, prompt=[a, b], n=2, max_tokens=5,
                                        temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert by_text.choices[0].text == by_text.choices[1].text  # greedy, same prompt
    ids = [tokenizer.encode(a), tokenizer.encode(b)]
    by_ids = client.completions.create(model=MODEL, prompt=ids, n=2, max_tokens=5,
                                       temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    echoed = client.completions.create(model=MODEL, prompt=a, echo=True, max_tokens=5,
                                       temperature=0)
    assert echoed.choices[0].text == a + by_text.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_never_shown(
    client: openai.OpenAI, tiny_stack: Stack, sync_redis: redis.Redis, stream: bool,
    include: bool,
) -> None:
    body = dict(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0)
    full = client.completions.create(**body).choices[0].text  # type: ignore[call-overload]
    # A stop string that starts inside one token and ends inside a later one.
    stop = full[len(full) // 2 - 3: len(full) // 2 + 4]
    cut = full.find(stop)
    want = full[: cut + len(stop)] if include else full[:cut]
    extra = {"stop": [stop, "never-appears"],
             "extra_body": {"include_stop_str_in_output": include}}
    if stream:
        raw = client.completions.with_raw_response.create(**body, **extra, stream=True)  # type: ignore[call-overload]
        chunks = list(raw.parse())
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        request_id = raw.headers["x-request-id"]
    else:
        raw = client.completions.with_raw_response.create(**body, **extra)  # type: ignore[call-overload]
        reply = raw.parse()
        text, finish = reply.choices[0].text, reply.choices[0].finish_reason
        request_id = raw.headers["x-request-id"]
    assert text == want and finish == "stop"
    # The worker was told to stop at once instead of running to max_tokens.
    keys = Keys(tiny_stack.prefix)
    assert eventually(lambda: sync_redis.hget(keys.state(request_id), "state") == b"aborted")
    assert int(sync_redis.hget(keys.state(request_id), "completion_tokens") or 0) < 60


def test_stop_token_ids_end_with_stop(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0)
    full = client.completions.create(**body, logprobs=0)  # type: ignore[call-overload]
    tokens = full.choices[0].logprobs.tokens
    stop_id = tokenizer.encode(tokens[4], add_special_tokens=False)
    if len(stop_id) != 1:
        pytest.skip("the 5th token does not round-trip alone")
    reply = client.completions.create(**body, extra_body={"stop_token_ids": stop_id})  # type: ignore[call-overload]
    first = next(i for i, t in enumerate(tokens) if tokenizer.encode(t, add_special_tokens=False)
                 == stop_id)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == "".join(tokens[:first])
    assert reply.usage.completion_tokens == first + 1  # the stop token counts, unshown


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=_msg("hi"), max_tokens=5,  # type: ignore[arg-type]
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.bytes == list(item.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=_msg("hi"), max_tokens=5,  # type: ignore[arg-type]
                                                temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    assert [t.token for t in streamed] == [t.token for t in content]


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                      temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4
    assert "".join(lp.tokens or []) == reply.choices[0].text
    assert all(len(top) <= 2 for top in lp.top_logprobs or [])
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(4)]


def test_logit_bias_forces_a_token(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    [token] = tokenizer.encode(" banana", add_special_tokens=False)
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0,
                                      logit_bias={str(token): 100})
    assert reply.choices[0].text == " banana" * 4


def test_sampling_fields_reach_the_worker(
    client: openai.OpenAI, tiny_stack: Stack, redis_url: str
) -> None:
    # A finished request's entry is deleted from the stream: catch it as it is added, with a
    # blocking read already waiting on the stream.
    stream = Keys(tiny_stack.prefix).requests(MODEL)
    sniffer = redis.Redis.from_url(redis_url, client_name="sniffer")
    seen: list[tuple[bytes, dict[bytes, bytes]]] = []
    reader = threading.Thread(target=lambda: seen.extend(
        e for _, entries in sniffer.xread({stream: "$"}, block=20_000) for e in entries))
    reader.start()
    assert eventually(lambda: any(c["name"] == "sniffer" and c["cmd"] == "xread"
                                  for c in sniffer.client_list()))
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=3, temperature=0.7, top_p=0.9, seed=11,
        presence_penalty=0.5, frequency_penalty=0.25, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True},
    )
    reader.join(20)
    sniffer.close()
    request_id = raw.headers["x-request-id"]
    [sent] = [GenerateRequest.from_fields(f) for _, f in seen if f[b"id"] == request_id.encode()]
    p = sent.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 20, 0.05, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.2)
    assert p.ignore_eos and raw.parse().usage.completion_tokens == 3  # type: ignore[union-attr]


def test_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 512 - 4
    assert reply.choices[0].finish_reason == "length"


def test_sse_framing(tiny_stack: Stack) -> None:
    body = {"model": MODEL, "messages": _msg("frame me"), "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    raw = httpx.post(f"{tiny_stack.base_url}/v1/chat/completions", json=body).text
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    # Each event: its ordinal as `id:` (for resuming), then one data line.
    for n, event in enumerate(events, start=1):
        id_line, data_line = event.split("\n")
        assert id_line == f"id: {n}" and data_line.startswith("data: ")
    assert events[-1].endswith("\ndata: [DONE]")
    payloads = [orjson.loads(e.split("\n")[1][6:]) for e in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_continuous_usage_stats_put_usage_in_every_chunk(
    aclient: openai.AsyncOpenAI, kind: str,
) -> None:
    """vLLM's `stream_options.continuous_usage_stats` (what guidellm sends): with include_usage,
    every chunk carries the usage so far; the last usage-only chunk still comes."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=_msg("count"), max_tokens=7, temperature=0, stream=True,
            stream_options=options)  # type: ignore[arg-type]
    else:
        stream = await aclient.completions.create(
            model=MODEL, prompt="count", max_tokens=7, temperature=0, stream=True,
            stream_options=options)  # type: ignore[arg-type]
    chunks = [chunk async for chunk in stream]
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert completion == sorted(completion) and completion[-1] == 7
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[0].usage.prompt_tokens  # type: ignore[union-attr]
               and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].choices == [] and len(set(completion)) > 2  # grew as tokens arrived
    # Without include_usage the flag asks for nothing, as in vLLM.
    plain = await aclient.chat.completions.create(
        model=MODEL, messages=_msg("count"), max_tokens=3, temperature=0, stream=True,
        stream_options={"continuous_usage_stats": True})  # type: ignore[arg-type]
    plain_chunks = [c async for c in plain]
    assert plain_chunks and all(c.usage is None for c in plain_chunks)
