"""The stream's keep-alive, as the official openai client reads it: a ping between numbered
events must not read as an event (the client keeps the last event id, so a comment and a
blank line would be an event with an id and no data, which it fails to parse)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from openai._streaming import SSEDecoder
from sse_starlette import ServerSentEvent

from api.render.stream import event_stream
from ops.embedded_redis import free_port

PING_S = 0.2
EVENTS = 4


async def _slow_events() -> AsyncIterator[ServerSentEvent]:
    """Numbered events with pings between them, as a reply waiting on a slow worker has."""
    for n in range(1, EVENTS + 1):
        await asyncio.sleep(PING_S * 3)
        yield ServerSentEvent(data=orjson.dumps({"n": n}).decode(), id=str(n), sep="\n")
    yield ServerSentEvent(data="[DONE]", id=str(EVENTS + 1), sep="\n")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> Response:
        return event_stream(_slow_events(), {}, None, PING_S)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/stream"
    server.should_exit = True
    thread.join(10)


def test_pings_between_numbered_events_are_no_events_to_the_openai_client(url: str) -> None:
    with httpx.stream("GET", url, timeout=30) as reply:
        raw = b"".join(reply.iter_raw())
    events = list(SSEDecoder().iter_bytes(iter([raw])))
    assert [e.data for e in events] == [*(f'{{"n":{n}}}' for n in range(1, EVENTS + 1)),
                                        "[DONE]"]
    assert [e.id for e in events] == [str(n) for n in range(1, EVENTS + 2)]
    assert raw.count(b": ping") >= EVENTS  # the keep-alive was sent, between the events
