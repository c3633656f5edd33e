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
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth.keys import APIKeys
from api.errors import error_body

GUARDED = "/v1/"
# Routes outside /v1/ that take a body and spend the replica's time on it: vLLM serves its
# tokenizer at the root, so redserve does too.
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
MAX_HEADER_BYTES = 64 * 1024
# The body was not read to its end: the connection cannot carry another request.
_CLOSE = [(b"connection", b"close")]


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
            await _reply(send, 431, error_body(
                f"the request headers are larger than the limit of {MAX_HEADER_BYTES} bytes",
                "invalid_request_error", None, "headers_too_large"), _CLOSE)
            return
        if not (scope["path"].startswith(GUARDED) or scope["path"] in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = self.keys.tenant(headers.get("authorization"))
        if tenant is None:
            given = "authorization" in headers
            await _reply(send, 401, error_body(
                "Incorrect API key provided." if given else
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error", None, "invalid_api_key"),
                [(b"www-authenticate", b'Bearer realm="redserve"'), *_CLOSE])
            return
        scope.setdefault("state", {})["tenant"] = tenant
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send)
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            await _reply(send, 408, error_body(
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                "invalid_request_error", None, "request_timeout"), _CLOSE)
            return
        if body is None:
            return  # gone before it finished sending: nothing to answer
        if len(body) > self.max_body_bytes:
            await self._too_large(send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or as soon as it passes the limit what came so far; None if the
        client left."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes or not message.get("more_body", False):
                return bytes(body)

    async def _too_large(self, send: Send) -> None:
        await _reply(send, 413, error_body(
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            "invalid_request_error", None, "request_too_large"), _CLOSE)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send: Send, status: int, payload: dict[str, Any],
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
    content = orjson.dumps(payload)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
        *(extra or [])]})
    await send({"type": "http.response.body", "body": content})
