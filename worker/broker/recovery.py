"""Taking over the requests of a worker that died.

A request stays pending in the consumer group from the moment a worker reads it until that
worker writes its terminal entry (XACK + XDEL in the same pipeline). Live workers keep their
pending entries fresh by re-claiming them to themselves (XCLAIM with JUSTID resets the idle
time) every heartbeat, so an entry idle for longer than `reclaim_after_s` belongs to a worker
that stopped beating. Any worker with room claims such entries (XPENDING with IDLE, walking the
group's pending list with its cursor across calls, so a long list is covered in turn rather than
its head over and over, then XCLAIM with the same idle bound, so two workers never both claim
one). Entries pending under the queue's consumer (`QUEUED_CONSUMER`) are requests still waiting
in the queue, not abandoned ones: recovery leaves them to the take script
(shared/scripts/take.py) and resumes each request from its prompt plus the tokens its client may
have seen: those in its result stream, then those its dead worker had sent only to the replica's
feed (the record trails the feed by up to a chunk: worker/broker/record.py), read back from the
feed after the record's last entry and recorded by the new worker. They are prefilled, not
generated again, so the client sees neither a gap nor a repeat, and seeded sampling continues
where it was (the seed of each token depends only on its position). A worker restarted under the
same name (as `redserve up` restarts them) takes back its own pending entries at once. A request
delivered too many times ends with an error entry instead of taking down worker after worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from shared.keys import QUEUED_CONSUMER, WORKER_GROUP, Keys, replica_of
from shared.messages import (
    Error,
    GenerateRequest,
    RequestField,
    Tokens,
    decode_feed,
    decode_result,
    expand,
    feed_payload,
    is_terminal,
)
from shared.redis_conn import StreamEntries, stream_reply

log = logging.getLogger("redserve.worker")

# Pending entries looked at per claim: queued ones among them are skipped.
PAGE = 100
# The feed read after a record's last entry: from a little before it (another key's ids may
# run a little ahead), to well past when its dead worker would have written the next chunk
# (0.5 s and a step: worker/broker/record.py).
FEED_BEFORE_MS = 2_000
FEED_AFTER_MS = 10_000
FEED_PAGE = 1_000


@dataclass(frozen=True)
class Claimed:
    entry_id: str
    request: GenerateRequest
    generated: tuple[int, ...]  # tokens its earlier worker published
    ended: bool  # its result stream already holds a terminal entry
    deliveries: int
    aborted: bool = False  # its abort key is set (filled in at intake)
    unrecorded: Tokens | None = None  # the end of `generated` found only in the feed
    # The feed no longer reaches back to its record's end (trimmed): tokens its client saw
    # may be missing from `generated`.
    tail_lost: bool = False
    # Traced: the `traceparent` of its span on the worker before (a takeover links to it).
    previous_trace: str | None = None


class Recovery:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, name: str,
                 reclaim_after_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.requests(model)
        self.name = name
        self.reclaim_after_ms = int(reclaim_after_s * 1000)
        self._cursor = "-"  # XPENDING's start: "-" or "(<entry id>" (after it)

    async def touch(self, entry_ids: Iterable[str]) -> None:
        """Reset the idle time of the entries this worker holds: they are alive."""
        ids: list[int | bytes | str | memoryview] = list(entry_ids)
        if ids:
            await self.redis.xclaim(self.stream, WORKER_GROUP, self.name, 0, ids, justid=True)

    async def taken_by_others(self) -> set[str]:
        """The ids of entries pending under another worker's name (after an outage: those
        another worker claimed from this one meanwhile)."""
        try:
            found = await self.redis.xpending_range(self.stream, WORKER_GROUP, "-", "+",
                                                    100_000)
        except aioredis.ResponseError as e:
            if "NOGROUP" in str(e):
                return set()
            raise
        return {_text(p["message_id"]) for p in found if _text(p["consumer"]) != self.name}

    async def own_pending(self) -> list[Claimed]:
        """The entries still pending under this worker's name: those of an earlier process
        of the same name, which crashed."""
        reply = await self.redis.xreadgroup(WORKER_GROUP, self.name, {self.stream: "0"},
                                            count=10_000)
        replies = stream_reply(reply)
        claimed = await self._inspect_all(replies[0][1] if replies else [])
        if claimed:
            log.warning("took back %d request(s) of an earlier process named %s",
                        len(claimed), self.name)
        return claimed

    async def claim(self, room: int) -> list[Claimed]:
        """Up to `room` requests abandoned by dead workers, now this worker's."""
        if room <= 0:
            return []
        found = await self.redis.xpending_range(self.stream, WORKER_GROUP, self._cursor, "+",
                                                PAGE, idle=self.reclaim_after_ms)
        abandoned = [_text(p["message_id"]) for p in found
                     if _text(p["consumer"]) != QUEUED_CONSUMER]
        ids = abandoned[:room]
        if len(abandoned) > room:
            self._cursor = f"({ids[-1]}"
        elif len(found) == PAGE:
            self._cursor = f"({_text(found[-1]['message_id'])}"
        else:
            self._cursor = "-"  # the end of the list: from its head next time
        if not ids:
            return []
        entries = cast(StreamEntries, await self.redis.xclaim(
            self.stream, WORKER_GROUP, self.name, self.reclaim_after_ms,
            ids))  # type: ignore[arg-type]
        if len(entries) < len(ids):
            # Entries trimmed (older than the request TTL) while pending, or claimed by
            # another worker just now: XCLAIM drops the trimmed from the pending list.
            log.info("%d abandoned entr(ies) were trimmed or claimed by another worker",
                     len(ids) - len(entries))
        claimed = await self._inspect_all([(i, f) for i, f in entries if f is not None])
        if claimed:
            log.warning("claimed %d request(s) from a dead worker", len(claimed))
        return claimed

    async def _inspect_all(self, entries: StreamEntries) -> list[Claimed]:
        claimed: list[Claimed] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            try:
                request = GenerateRequest.from_fields(fields)
            except (KeyError, TypeError, ValueError):
                log.error("dropping malformed request entry %s", entry_id)
                pipe = self.redis.pipeline(transaction=False)
                pipe.xack(self.stream, WORKER_GROUP, entry_id)
                pipe.xdel(self.stream, entry_id)
                await pipe.execute()
                continue
            claimed.append(await self._inspect(entry_id, request))
        return claimed

    async def _inspect(self, entry_id: str, request: GenerateRequest) -> Claimed:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xpending_range(self.stream, WORKER_GROUP, entry_id, entry_id, 1)
        pipe.xrange(self.keys.out(request.id))
        if request.traceparent is not None:  # traced: the span of the worker before
            pipe.hget(self.keys.state(request.id), RequestField.WORKER_TRACE)
        pending, results, *previous = await pipe.execute()
        deliveries = int(pending[0]["times_delivered"]) if pending else 1
        generated: list[int] = []
        ended = False
        for _, fields in results:
            ended = ended or is_terminal(fields)
            for entry in expand(decode_result(fields)):
                if isinstance(entry, Tokens) and entry.index == len(generated):
                    generated.extend(entry.ids)
        unrecorded, lost = None, False
        if results and not ended:
            unrecorded, lost = await self._feed_tail(request.id, results[-1][0],
                                                     len(generated))
            generated.extend(unrecorded.ids if unrecorded else ())
        return Claimed(entry_id, request, tuple(generated), ended, deliveries,
                       unrecorded=unrecorded, tail_lost=lost,
                       previous_trace=_text(previous[0]) if previous and previous[0] else None)

    async def _feed_tail(self, request_id: str, record_end: bytes,
                         index: int) -> tuple[Tokens | None, bool]:
        """The request's tokens from `index` on that its replica's feed holds after the
        record's last entry (written before them, in the same pipeline), and whether the feed
        no longer reaches back that far."""
        end_ms = int(record_end.split(b"-")[0])
        start, stop = f"{end_ms - FEED_BEFORE_MS}-0", f"{end_ms + FEED_AFTER_MS}-0"
        feed, key = self.keys.feed(replica_of(request_id)), request_id.encode()
        # Trimming takes the oldest first: if what is left starts after the record's end, what
        # came just after it may be gone. No feed at all: its replica is gone, and with it
        # every client that read the feed (a resume reads the record).
        first = cast(StreamEntries, await self.redis.xrange(feed, "-", "+", count=1))
        if not first:
            return None, False
        if int(first[0][0].split(b"-")[0]) > end_ms:
            return None, True
        found: list[Tokens] = []
        while True:
            page = cast(StreamEntries, await self.redis.xrange(feed, start, stop,
                                                               count=FEED_PAGE))
            for _, fields in page:
                if key not in feed_payload(fields):
                    continue
                entry = decode_feed(fields).get(request_id)
                for part in expand(decode_result(entry)) if entry else ():
                    if isinstance(part, Tokens) and part.index == index:
                        found.append(part)
                        index = part.end
            if len(page) < FEED_PAGE:
                break
            start = f"({page[-1][0].decode()}"
        return (Tokens.joined(found) if found else None), False


def lost_tail(claimed: Claimed) -> Error | None:
    """A sampled request whose client may have seen tokens that neither its record nor the
    feed holds any more: continuing would show the client a different text after them.
    A greedy one continues (its lost tokens come out the same again)."""
    if not claimed.tail_lost or claimed.request.params.temperature == 0:
        return None
    return Error("the request's worker stopped and the tokens it streamed last are no longer "
                 "in Redis, so it cannot continue without a gap", "server_error",
                 "worker_failed")


def too_many_deliveries(claimed: Claimed, limit: int) -> Error | None:
    if claimed.deliveries <= limit:
        return None
    return Error(f"the request was taken by {claimed.deliveries - 1} workers that all stopped "
                 "before finishing it", "server_error", "worker_failed")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
