"""The one walk every reply is rendered from: a request's choices' result entries, interleaved
as they arrive, as per-choice events (text with its logprobs, tool calls, a choice's end, a
failure). Stop strings, duplicate tokens and tool-call parsing stay in `Choice`; what a wire
format makes of each event is its renderer's (`api.render.renderer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from api.protocol.tools.parse import ParsedCall
from api.render.choices import Choice, TokenLogprob
from shared.messages import Error, Finish, Tokens


@dataclass(frozen=True)
class Text:
    choice: Choice
    text: str
    logprobs: list[TokenLogprob]  # of the tokens this text came from; [] when not asked for


@dataclass(frozen=True)
class Calls:
    choice: Choice
    calls: list[ParsedCall]  # each whole: name, id and all of its arguments


@dataclass(frozen=True)
class End:
    choice: Choice
    finish_reason: str


@dataclass(frozen=True)
class Failure:
    error: Error  # the walk ends with it


Event = Text | Calls | End | Failure


async def walk(choices: list[Choice]) -> AsyncIterator[Event]:
    """Every choice's events until each has ended, or the first failure. A choice ended by a
    stop string closes its generation ("stop", telling the worker to stop now) once its `End`
    is handled; the worker's late entries for it are moot."""
    running = len(choices)
    async with aclosing(entries(choices)) as arriving:
        async for choice, entry in arriving:
            if choice.finish_reason is not None:
                continue
            if isinstance(entry, Tokens):
                text, items, calls = choice.on_tokens(entry)
            elif isinstance(entry, Finish):
                text, calls = choice.on_finish(entry)
                items = []
            else:
                yield Failure(entry)
                return
            if text or items:
                yield Text(choice, text, items)
            if calls:
                yield Calls(choice, calls)
            if choice.finish_reason is not None:
                yield End(choice, choice.finish_reason)  # sent before the abort's round trip
                if isinstance(entry, Tokens):
                    await choice.generation.close("stop")
                running -= 1
                if not running:
                    return
    yield Failure(Error("result stream ended without a terminal entry", "server_error",
                        "internal_error"))


async def entries(choices: list[Choice]) -> AsyncGenerator[tuple[Choice, Any]]:
    """Every choice's result entries as they arrive, interleaved, one token an entry: a reply
    is then the same whether its tokens came one a step from the feed or in chunks from the
    record (a client that fell behind, a resumed stream: api/queue/replay.py), its SSE events and
    where a stop string cuts it alike."""
    async for choice, entry in _interleaved(choices):
        for part in entry.split() if isinstance(entry, Tokens) else (entry,):
            yield choice, part


async def _interleaved(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Any]]:
    if len(choices) == 1:
        async for entry in choices[0].generation:
            yield choices[0], entry
        return
    merged: asyncio.Queue[tuple[Choice, Any] | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for entry in choice.generation:
                await merged.put((choice, entry))
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await merged.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def close_all(choices: list[Choice]) -> None:
    for choice in choices:
        await choice.generation.close()
