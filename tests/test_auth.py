"""API keys and tenancy on a real stack: no /v1/ route answers without a valid key (probes
do), keys come from the environment and from a file, and a request belongs to its key's
tenant: any key of that tenant may cancel or resume it, and to every other tenant it does not
exist."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis

from shared.keys import Keys
from tests.stack import Stack, eventually

MODEL = "tiny-llama"
ALICE_1 = "sk-alice-first-key"
ALICE_2 = "sk-alice-rotated-key"
MALLORY = "sk-mallory-key-0000"
BOB = "sk-bob-key-from-a-file"
# Speculation off: at temperature 0 the tiny model repeats itself, and its drafts would end a
# request meant to stay busy within a few steps.
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 480, "ignore_eos": True,
        "temperature": 0, "speculation": False, "stream": True}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text(f"# the team's keys\nbob:{BOB}\n\n")
    stack = Stack(redis_url, tiny_model, served_name=MODEL, env={
        "REDSERVE_API_KEYS": f"alice:{ALICE_1}, alice:{ALICE_2},mallory:{MALLORY}",
        "REDSERVE_API_KEYS_FILE": str(keys_file),
    }).start()
    yield stack
    stack.stop()


def test_v1_routes_need_a_valid_key_and_probes_do_not(keyed: Stack) -> None:
    url = keyed.base_url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, _auth("sk-not-a-key-at-all"), {"Authorization": ALICE_1},
                    {"Authorization": "Basic " + ALICE_1}):
        for response in (httpx.post(f"{url}/v1/completions", json=body, headers=headers),
                         httpx.get(f"{url}/v1/models", headers=headers),
                         httpx.post(f"{url}/v1/requests/x-y/cancel", headers=headers)):
            assert response.status_code == 401, response.text
            assert response.headers["www-authenticate"].startswith("Bearer")
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{url}{probe}").status_code == 200
    assert httpx.get(f"{url}/health").json()["auth"] == "on"

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong-key-xx", max_retries=0
                      ).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    for key in (ALICE_1, ALICE_2, MALLORY, BOB):  # from the environment and from the file
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_a_stranger_is_refused_before_the_body_is_read(keyed: Stack) -> None:
    # Far over the body limit: a stranger gets 401, not 413, and the body is never taken in.
    huge = b'{"prompt": "' + b"a" * (8 * 1024**2) + b'"}'
    response = httpx.post(f"{keyed.base_url}/v1/completions", content=huge,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 401


def test_a_request_belongs_to_its_tenant_not_to_its_key(keyed: Stack) -> None:
    url = keyed.base_url
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, headers=_auth(ALICE_1),
                      timeout=30) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # Another tenant can neither cancel it nor resume it: to them it does not exist.
        for stranger in (MALLORY, BOB):
            cancel = httpx.post(f"{url}/v1/requests/{request_id}/cancel",
                                headers=_auth(stranger))
            assert cancel.status_code == 404 and cancel.json()["error"]["code"] == "not_found"
            resume = httpx.get(f"{url}/v1/requests/{request_id}/stream",
                               headers=_auth(stranger))
            assert resume.status_code == 404
        # Alice's other key is Alice.
        cancelled = httpx.post(f"{url}/v1/requests/{request_id}/cancel", headers=_auth(ALICE_2))
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        events = [orjson.loads(line[6:]) for line in lines
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 480
    again = httpx.delete(f"{url}/v1/requests/{request_id}", headers=_auth(ALICE_1))
    assert again.json() == {"id": request_id, "object": "request", "state": "aborted",
                            "cancelled": False}
    assert httpx.delete(f"{url}/v1/requests/nonsense", headers=_auth(ALICE_1)).status_code == 404
    # An id that names another kind of key is no request either, for anyone.
    for key in (ALICE_1, MALLORY):
        for suffix in (":out", ":abort", "-1"):
            other = httpx.delete(f"{url}/v1/requests/{request_id}{suffix}", headers=_auth(key))
            assert other.status_code == 404, other.text


def test_tenants_share_no_prefix_cache(keyed: Stack) -> None:
    # Were pages shared, Mallory could learn whether Alice's prompts start with a guess from
    # `cached_tokens`.
    body = {"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 1}

    def cached(key: str) -> int:
        reply = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=key, max_retries=0
                              ).completions.create(**body)  # type: ignore[call-overload]
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return int(reply.usage.prompt_tokens_details.cached_tokens or 0)

    assert cached(ALICE_1) == 0
    assert cached(MALLORY) == 0 and cached(BOB) == 0
    assert cached(ALICE_2) > 0  # Alice's own pages serve all of Alice's keys


def test_one_tenant_cannot_fill_the_queue_for_everyone(redis_url: str, tiny_model: Path) -> None:
    # No worker: requests stay queued until their queue deadline.
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=0, env={
        "REDSERVE_API_KEYS": f"alice:{ALICE_1},mallory:{MALLORY}",
        "REDSERVE_MAX_QUEUED_PER_TENANT": "2", "REDSERVE_QUEUE_TIMEOUT_S": "3",
    }).start()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body,
                                   headers=_auth(key), timeout=30)
                       for key in (MALLORY, MALLORY, ALICE_1)]
            assert eventually(lambda: len(redis.Redis.from_url(redis_url).zrange(
                Keys(stack.prefix).queued(MODEL), 0, -1)) == 3)
            third = httpx.post(f"{stack.base_url}/v1/completions", json=body,
                               headers=_auth(MALLORY), timeout=30)
            assert third.status_code == 429, third.text
            assert "tenant" in third.json()["error"]["message"]
            # Alice's place is hers: she still gets in while Mallory is at her share.
            fourth = pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body,
                                 headers=_auth(ALICE_1), timeout=30)
            assert [f.result().status_code for f in [*waiting, fourth]] == [503] * 4
    finally:
        stack.stop()
