"""What both kinds of reply share: every choice's entries interleaved as they arrive, closing
them all, and the usage they add up to."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from api.choices import Choice, chat_logprobs, text_logprobs
from api.responses import ReplyHeader, usage
from shared.messages import Tokens


async def entries(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Any]]:
    """Every choice's result entries as they arrive, interleaved, one token an entry: a reply
    is then the same whether its tokens came one a step from the feed or in chunks from the
    record (a client that fell behind, a resumed stream: api/resume.py), its SSE events and
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


def logprobs_of(header: ReplyHeader, items: list[Any], offset: int
                ) -> dict[str, Any] | None:
    if not items:
        return None
    return chat_logprobs(items) if header.kind == "chat" else text_logprobs(items, offset)


def usage_of(choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    # Each prompt is counted once however many choices share it; so is its cache reuse.
    cached: dict[int, int] = {}
    for c in choices:
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
    # A choice still running has produced the tokens it has seen so far.
    completion = sum(c.completion_tokens if c.finish_reason else c.tokens_seen for c in choices)
    return usage(prompt_tokens, completion, sum(cached.values()))
