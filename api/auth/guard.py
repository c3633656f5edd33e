"""The door of every `/v1/` route, and of vLLM's `/tokenize` and `/detokenize` at the root,
before any of the body is read: the caller's API key (401 without a valid one) and the body's
size (413 past `max_body_bytes`). Headers past `MAX_HEADER_BYTES` are refused on every route
(431) before anything looks at them.

A pure ASGI middleware rather than a FastAPI dependency, because FastAPI reads and parses the
whole body before it resolves dependencies: a stranger, or an oversized body, would cost the
replica that work first. The body is read here, up to the limit and within
`body_timeout_s` (a client trickling bytes gets 408, not a connection held for ever), and
handed on whole; later `receive` calls go to the server as usual, so a handler still sees the
client's disconnect.
The caller's tenant is left in `request.state.tenant`.

A refusal (431, 401, 413) closes the connection, but not at once: a client that is still
sending its body would get a TCP reset (the kernel resets a connection closed with unread data
in it), and see that instead of the answer, which is then lost to it (an OpenAI client retries
a reset). So the whole answer is sent first, then the rest of the body is read and dropped,
up to `LINGER_BYTES` or for `LINGER_S`, whichever comes first, and only then is the connection
closed: a bounded lingering close, as nginx does. A client that asked to be told before it
sends (`Expect: 100-continue`) sends nothing more, so it is not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth.keys import APIKeys
from api.protocol.errors import error_body

GUARDED = "/v1/"
# Routes outside /v1/ that take a body and spend the replica's time on it: vLLM serves its
# tokenizer at the root, so redserve does too.
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
MAX_HEADER_BYTES = 64 * 1024
# The body was not read to its end: the connection cannot carry another request.
_CLOSE = [(b"connection", b"close")]
# After a refusal, what is read and dropped of a body still coming, at most, before the close.
LINGER_BYTES = 64 * 1024**2
LINGER_S = 5.0


class Guard:
    def __init__(self, app: ASGIApp, keys: APIKeys, max_body_bytes: int,
                 body_timeout_s: float) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            await _refuse(send, receive, scope, 431, error_body(
                f"the request headers are larger than the limit of {MAX_HEADER_BYTES} bytes",
                "invalid_request_error", None, "headers_too_large"))
            return
        if not (scope["path"].startswith(GUARDED) or scope["path"] in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = self.keys.tenant(headers.get("authorization"))
        if tenant is None:
            given = "authorization" in headers
            await _refuse(send, receive, scope, 401, error_body(
                "Incorrect API key provided." if given else
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error", None, "invalid_api_key"),
                [(b"www-authenticate", b'Bearer realm="redserve"')])
            return
        scope.setdefault("state", {})["tenant"] = tenant
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send, receive, scope)
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                read = await self._read_body(receive)
        except TimeoutError:  # a client this slow is not waited for again
            await _reply(send, 408, error_body(
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                "invalid_request_error", None, "request_timeout"), _CLOSE)
            return
        if read is None:
            return  # gone before it finished sending: nothing to answer
        body, whole = read
        if len(body) > self.max_body_bytes:
            await self._too_large(send, receive, scope, unread=not whole)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool] | None:
        """The whole body, or as soon as it passes the limit what came so far, and whether
        that is all of it; None if the client left."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if not message.get("more_body", False):
                return bytes(body), True
            if len(body) > self.max_body_bytes:
                return bytes(body), False

    async def _too_large(self, send: Send, receive: Receive, scope: Scope,
                         unread: bool = True) -> None:
        await _refuse(send, receive, scope, 413, error_body(
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            "invalid_request_error", None, "request_too_large"), unread=unread)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, receive: Receive, scope: Scope, status: int,
                  payload: dict[str, Any], extra: list[tuple[bytes, bytes]] | None = None,
                  unread: bool = True) -> None:
    """Answer `status` and close, lingering first if some of the body is `unread`: the
    answer goes out whole, then what the client still sends of its body is dropped
    (bounded), then the response ends and the server closes the connection."""
    await _reply(send, status, payload, [*(extra or []), *_CLOSE], more=True)
    if unread and not any(name == b"expect" and value.lower() == b"100-continue"
                          for name, value in scope["headers"]):
        await _drop_body(receive)
    await send({"type": "http.response.body", "body": b""})


async def _drop_body(receive: Receive) -> None:
    """Read what is left of the request's body and drop it, up to `LINGER_BYTES` or for
    `LINGER_S`."""
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while dropped <= LINGER_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body"):
                    return
                dropped += len(message.get("body", b""))


async def _reply(send: Send, status: int, payload: dict[str, Any],
                 extra: list[tuple[bytes, bytes]] | None = None, more: bool = False) -> None:
    """The whole answer; `more`: the response is ended later, by an empty body."""
    content = orjson.dumps(payload)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
        *(extra or [])]})
    await send({"type": "http.response.body", "body": content, "more_body": more})
