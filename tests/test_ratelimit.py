"""Per-tenant rate limits through the real stack: two API replicas sharing one Redis, one
worker on the tiny model, API keys of several tenants and a tenants file. Each test uses its
own tenant, so their buckets never meet."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.keys import Keys
from shared.messages import BUCKET_TTL_MS, Bucket, BucketField
from tests.stack import Stack, child_env, eventually, inspect_json

MODEL = "tiny-llama"
TENANTS = """
[tenants.few]
requests_per_minute = 3

[tenants.tok]
tokens_per_minute = 100

[tenants.hdr]
requests_per_minute = 100
tokens_per_minute = 100000

[tenants.settle]
tokens_per_minute = 600

[tenants.shared]
requests_per_minute = 4

[tenants.refill]
requests_per_minute = 60

[tenants.many]
tokens_per_minute = 100000

[tenants.free]
requests_per_minute = 0
"""
NAMES = ("few", "tok", "hdr", "many", "settle", "shared", "refill", "free", "dflt")
DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


def key(tenant: str) -> str:
    return f"key-of-{tenant}-0123456789"


@pytest.fixture(scope="module")
def stack(redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, env={
        "REDSERVE_API_KEYS": ",".join(f"{t}:{key(t)}" for t in NAMES),
        "REDSERVE_TENANTS_FILE": str(tenants),
        "REDSERVE_REQUESTS_PER_MINUTE": "1000",  # the default: `dflt` is not in the file
    }).start()
    yield stack
    stack.stop()


def complete(stack: Stack, tenant: str, replica: int = 0, **body: Any) -> httpx.Response:
    return httpx.post(f"{stack.url(replica)}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key(tenant)}"},
                      json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, **body})


def client(stack: Stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key(tenant), max_retries=0)


def test_requests_limit_answers_openais_429(stack: Stack) -> None:
    remaining = [complete(stack, "few").headers["x-ratelimit-remaining-requests"]
                 for _ in range(3)]
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as caught:
        client(stack, "few").completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    error = caught.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.type == "requests" and error.param is None
    assert re.search(r"on requests per min \(RPM\): Limit 3, Used 3, Requested 1\. Please "
                     r"try again in \S+s\.", error.message), error.message
    headers = error.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert DURATION.match(headers["x-ratelimit-reset-requests"])
    assert "x-ratelimit-limit-tokens" not in headers  # no tokens limit for this tenant
    # Other tenants are untouched: one with no limit at all (and no headers), one with the
    # default of the settings.
    free = complete(stack, "free")
    assert free.status_code == 200 and not any(h.startswith("x-ratelimit") for h in free.headers)
    default = complete(stack, "dflt")
    assert default.status_code == 200
    assert default.headers["x-ratelimit-limit-requests"] == "1000"
    metrics = stack.metrics(f"{stack.base_url}/metrics")
    assert metrics['redserve_api_rate_limited_total{limit="requests",tenant="few"}'] == 1


def test_headers_on_every_reply_streamed_or_not(stack: Stack) -> None:
    whole = complete(stack, "hdr", max_tokens=4)
    assert whole.status_code == 200, whole.text
    h = whole.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-limit-tokens"]) == ("100", "100000")
    assert h["x-ratelimit-remaining-requests"] == "99"
    assert h["x-ratelimit-remaining-tokens"] == str(100000 - 3 - 4)
    assert DURATION.match(h["x-ratelimit-reset-requests"]), h["x-ratelimit-reset-requests"]
    assert DURATION.match(h["x-ratelimit-reset-tokens"]), h["x-ratelimit-reset-tokens"]
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key('hdr')}"},
                      json={"model": MODEL, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert int(streamed.headers["x-ratelimit-remaining-requests"]) <= 98
        assert streamed.headers["x-ratelimit-limit-tokens"] == "100000"
        assert "[DONE]" in "".join(streamed.iter_text())


def test_n_choices_reserve_max_tokens_each_and_the_prompt_once(stack: Stack) -> None:
    reply = complete(stack, "many", max_tokens=4, n=3)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 3
    assert reply.headers["x-ratelimit-remaining-tokens"] == str(100000 - 3 - 3 * 4)
    # The file sets only its tokens: its requests limit is the default's.
    assert reply.headers["x-ratelimit-limit-requests"] == "1000"


def test_tokens_limit_counts_prompt_and_max_tokens(stack: Stack) -> None:
    first = complete(stack, "tok", max_tokens=60, ignore_eos=True)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 60
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100 - 63
    with pytest.raises(openai.RateLimitError) as caught:
        client(stack, "tok").completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=60)
    assert caught.value.type == "tokens" and caught.value.code == "rate_limit_exceeded"
    assert re.search(r"on tokens per min \(TPM\): Limit 100, Used \d+, Requested 63\.",
                     caught.value.message), caught.value.message
    # More than the whole minute's tokens: no wait makes it fit, and the message says so.
    too_large = complete(stack, "tok", max_tokens=200)
    assert too_large.status_code == 429 and int(too_large.headers["retry-after"]) >= 1
    error = too_large.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert "Request too large" in error["message"] and "Requested 203" in error["message"]


def tokens_left(r: redis.Redis, stack: Stack, tenant: str) -> float:
    """A tenant's tokens now, read as `redserve inspect` does."""
    raw = r.hmget(Keys(stack.prefix).limits(MODEL, tenant), list(BucketField))
    seconds, micros = r.time()
    bucket = Bucket.decode(dict(zip(BucketField, [None if v is None else v.decode()
                                                  for v in raw], strict=True)))
    return bucket.at(seconds * 1000 + micros // 1000).tokens


def test_unused_tokens_are_given_back_when_the_reply_ends(stack: Stack,
                                                          sync_redis: redis.Redis) -> None:
    # Token 42 is pushed to the top and stops the choice: one token of the 300 reserved.
    short = complete(stack, "settle", max_tokens=300, logit_bias={"42": 100},
                     stop_token_ids=[42])
    assert short.status_code == 200, short.text
    used = 3 + short.json()["usage"]["completion_tokens"]
    assert short.json()["usage"]["completion_tokens"] <= 2
    assert int(short.headers["x-ratelimit-remaining-tokens"]) == 600 - 303
    after = complete(stack, "settle", max_tokens=1)
    # Settled: only what the first reply used is missing (the refill, 10 tokens a second,
    # could not give back the ~300 reserved and unused within this test).
    assert int(after.headers["x-ratelimit-remaining-tokens"]) >= 600 - used - 4
    # A stream is settled too, once it ends (after its last event: polled).
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key('settle')}"},
                      json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 300,
                            "stream": True, "logit_bias": {"42": 100},
                            "stop_token_ids": [42]}) as streamed:
        assert int(streamed.headers["x-ratelimit-remaining-tokens"]) < 600 - 303 + 50
        assert "[DONE]" in "".join(streamed.iter_text())
    assert eventually(lambda: tokens_left(sync_redis, stack, "settle") >= 600 - 3 * 8, 5.0)


def test_one_budget_across_replicas(stack: Stack) -> None:
    remaining = [complete(stack, "shared", replica=i % 2).headers[
        "x-ratelimit-remaining-requests"] for i in range(4)]
    assert remaining == ["3", "2", "1", "0"]
    for replica in (0, 1):
        refused = complete(stack, "shared", replica=replica)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"


def test_refills_after_the_reset(stack: Stack, sync_redis: redis.Redis) -> None:
    # The test plays a replica that just spent the tenant's last request.
    bucket = Keys(stack.prefix).limits(MODEL, "refill")
    seconds, micros = sync_redis.time()
    sync_redis.hset(bucket, mapping={
        BucketField.REQUESTS: 0, BucketField.TOKENS: 0, BucketField.AT: seconds * 1000 + micros
        // 1000, BucketField.REQUESTS_LIMIT: 60, BucketField.TOKENS_LIMIT: 0})
    sync_redis.pexpire(bucket, BUCKET_TTL_MS)
    refused = complete(stack, "refill")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"  # 60 a minute: one a second
    time.sleep(1.05)
    admitted = complete(stack, "refill")
    assert admitted.status_code == 200, admitted.text
    assert int(admitted.headers["x-ratelimit-remaining-requests"]) <= 1
    # `redserve inspect` shows the bucket as it stands.
    limits = inspect_json(stack)["limits"]
    mine = next(v for v in limits if v["tenant"] == "refill")
    assert mine["model"] == MODEL and mine["requests_limit"] == 60
    assert 0 <= mine["requests_remaining"] <= 60 and mine["tokens_remaining"] is None
    assert 0 < sync_redis.pttl(bucket) <= BUCKET_TTL_MS


@pytest.mark.parametrize("command", ["api", "up"])
def test_a_bad_tenants_file_refuses_to_start(command: str, tmp_path: Path, redis_url: str,
                                             tiny_model: Path) -> None:
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.acme]\nrequests_per_minute = -5\n")
    env = child_env(redis_url, "rstest-bad-tenants", REDSERVE_TENANTS_FILE=str(bad))
    done = subprocess.run([sys.executable, "-m", "ops.cli", command, "--model", str(tiny_model),
                           "--port", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "tenant 'acme' of the tenants file: requests_per_minute must be a whole number" \
        in done.stderr
