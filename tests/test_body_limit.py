"""An over-large body gets its 413 and OpenAI error object, read by a client that is still
sending it: the replica answers, then reads and drops the rest of the body (bounded) before it
closes, instead of closing at once, which resets the connection under the client (an OpenAI
client would see a connection error, and retry it).

Real replica, real clients: httpx and the official `openai` package, with a messages array
of 3 MB and a body of 50 MB against the default limit (REDSERVE_MAX_BODY_BYTES, 2 MiB), sent
with a Content-Length (refused before any of it is read) and chunked (refused once the limit
is passed). httpx (under both) reads the answer even after a failed send, and on loopback the
answer arrives before the reset, so it got the 413 even before the lingering close; a client
that sends its whole request before it reads (curl, a plain socket here) did not: its send
failed (broken pipe)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.stack import Stack

MODEL = "tiny-llama"
SIZES = {"3MB-messages": 3 * 1024**2, "50MB": 50 * 1024**2}


@pytest.fixture(scope="module")
def replica(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, workers=0).start()
    yield stack
    stack.stop()


def _messages(size: int) -> list[dict[str, str]]:
    """A messages array of about `size` bytes, in messages of 1 KiB."""
    return [{"role": "user", "content": "a" * 1024}] * (size // 1024)


def _refused(status: int, body: object) -> None:
    assert status == 413
    assert isinstance(body, dict)
    error = body["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "limit" in error["message"]


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_httpx_reads_the_413_of_a_body_it_is_still_sending(replica: Stack, size: int) -> None:
    content = orjson.dumps({"model": MODEL, "messages": _messages(size)})
    url = f"{replica.base_url}/v1/chat/completions"
    reply = httpx.post(url, content=content, timeout=60,
                       headers={"content-type": "application/json"})
    _refused(reply.status_code, reply.json())

    def chunks() -> Iterator[bytes]:  # no Content-Length: read until past the limit
        for start in range(0, len(content), 64 * 1024):
            yield content[start:start + 64 * 1024]

    reply = httpx.post(url, content=chunks(), timeout=60,
                       headers={"content-type": "application/json"})
    _refused(reply.status_code, reply.json())
    # The replica serves on.
    assert httpx.get(f"{replica.base_url}/health").status_code == 200


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_the_openai_client_gets_the_413_not_a_connection_error(replica: Stack,
                                                                size: int) -> None:
    client = openai.OpenAI(base_url=f"{replica.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=_messages(size),  # type: ignore[arg-type]
                                       max_tokens=4)
    _refused(refused.value.status_code, refused.value.body and {"error": refused.value.body})


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_a_client_that_sends_all_before_it_reads_is_not_reset(replica: Stack,
                                                              size: int) -> None:
    # As curl and most clients do: the whole body goes out first (a reset fails the send,
    # and the answer is lost), then the answer is read to the close.
    content = orjson.dumps({"model": MODEL, "messages": _messages(size)})
    with socket.create_connection(("127.0.0.1", replica.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(content))
        conn.sendall(content)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in head.lower()
    _refused(413, orjson.loads(body))
