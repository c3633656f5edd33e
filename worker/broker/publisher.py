"""The worker's Redis writes: everything a step produces goes out in one pipeline, and no
terminal entry is ever lost.

Staged per step, sent by `flush`:
- requests admitted (their state; their queue places were freed by the take itself, see
  worker/broker/take.py);
- the record chunks that are due (worker/broker/record.py: a request's first token at once, then
  every 16 tokens or 0.5 s; one XADD each, the first also sets its stream's TTL);
- ended requests: one entry carrying the unrecorded tokens and the finish (or a chunk, then an
  error), and the short TTL of a finished request on its stream and hash;
- then, per API replica, one feed entry with the step's result entries of its requests (see
  shared/keys.py): its reader reads the whole step in one command, and this is how tokens
  reach clients as they come;
- at most every `BATCH_S` (at once when idle): one XACK and one XDEL of every entry ended
  since, so the request stream holds only unfinished work. An entry whose terminal entry is
  written is safe to acknowledge late: a worker that claims it finds the terminal entry and
  only acknowledges it;
- requests handed back on drain.
Commands per generated token are the budget (see ops/benchmarks/redis_cost.py): per step,
one feed entry per replica, whatever the number of requests; per request, a few chunks.

A flush that fails (Redis went away) keeps what must not be lost: the record chunks, terminal
entries, acks and hand-backs go to an outbox that every later flush retries first, until it
is written or the request's keys would have expired anyway. A retried terminal entry is added,
with its request's retried chunks before it, only if its stream does not end with one already
(a pipeline may have been applied in part: shared/scripts/terminal.py), so every result
stream still ends with exactly one. The feed entries of a failed flush are not retried: the
record has their tokens, and a replica that missed them reads them there. A request's pending
entry stays in `entry_ids`, and is kept fresh by the heartbeat, until its terminal entry is
written; from then on nothing refreshes it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from shared.keys import WORKER_GROUP, Keys, replica_of
from shared.messages import (
    Error,
    Finish,
    GenerateRequest,
    RequestHash,
    Tokens,
    feed_fields,
    feed_min_id,
)
from shared.scripts.terminal import TERMINAL_ONCE, Terminal, TerminalArgs, TerminalKeys
from shared.settings import WorkerSettings
from worker.broker.metrics import WorkerMetrics
from worker.broker.record import Record
from worker.broker.staged import Ending, Staged
from worker.engine.engine import StepOutput

BATCH_S = 0.5
# Terminal entries written this recently are written again (if their record lacks one) after
# a failover: the old primary may have acknowledged them and never passed them on. Longer
# than a failover takes to be seen (`down-after-milliseconds`, the election, the watch).
RECENT_S = 10.0
# How often the offset between this clock and Redis's is read again (the feed is trimmed by
# Redis's clock, see `feed_min_id`).
CLOCK_S = 60.0


class Publisher:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, settings: WorkerSettings,
                 name: str, metrics: WorkerMetrics | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.name = name
        self.metrics = metrics
        self.requests_key = keys.requests(model)
        # request id -> its pending entry in the request stream, until its terminal entry is
        # written (the heartbeat keeps these fresh).
        self.entry_ids: dict[str, str] = {}
        self._expires: dict[str, float] = {}
        # Requests whose result stream exists already (and so carries its TTL).
        self._streams: set[str] = set()
        self.record = Record()
        self._staged = Staged()
        self._outbox = Staged()
        self._batch = Staged()  # acks, sent every BATCH_S
        self._batch_sent = 0.0
        self._terminal_once = TERMINAL_ONCE.bind(redis)
        # Endings written in the last RECENT_S, with their request-stream entries.
        self._recent: collections.deque[tuple[float, Ending, str | None]] = collections.deque()
        self._clock_offset = 0.0  # Redis's time less this machine's
        self._clock_read = float("-inf")  # monotonic time of the last read

    @property
    def backlog(self) -> int:
        """Terminal entries waiting for Redis."""
        return len(self._outbox.endings)

    def take(self, request: GenerateRequest, entry_id: str,
             unrecorded: Tokens | None = None) -> None:
        """A request taken from the queue: remember its entry. `unrecorded`: the tokens a
        dead worker published to the feed but not yet to the record, which it gets now."""
        self.entry_ids[request.id] = entry_id
        self._expires[request.id] = request.created + self.settings.request_ttl_s
        if unrecorded is not None:
            self._staged.records.append((request.id, unrecorded))

    def stage_ack(self, request_id: str) -> None:
        """Acknowledge a request that already ended elsewhere (its terminal entry exists)."""
        self._expires.pop(request_id, None)
        self.record.take(request_id)
        self._batch.acks.append(self.entry_ids.pop(request_id))

    def stage_hand_back(self, request_id: str) -> None:
        """Give a request back for another worker to claim at once: its pending entry is
        marked idle past the reclaim threshold. Unlike a re-added copy this is safe to
        repeat, and a request that already published tokens resumes from them."""
        self._expires.pop(request_id, None)
        self._stage_rest(request_id)  # the next worker resumes from the record
        self._staged.hand_backs.append((request_id, self.entry_ids.pop(request_id)))
        if self.metrics is not None:
            self.metrics.hand_back(request_id)

    def stage(self, outputs: Iterable[StepOutput]) -> None:
        """A step's outputs. A request's consecutive outputs (a speculating request emits
        several tokens a step) make one tokens entry, and one finish carrying them."""
        now = time.monotonic()
        for group in _by_request(outputs):
            last = group[-1]
            if last.error is not None:  # an error comes alone (worker/engine/engine.py)
                self.stage_error(last.request_id, last.error)
                continue
            tokens = _tokens(group)
            if tokens is not None:
                self.record.add(last.request_id, tokens, now)
            if last.finish is None:
                if tokens is not None:
                    self._staged.live.append((last.request_id, tokens.to_fields()))
                continue
            rid = last.request_id
            counts = last.prompt_tokens, last.completion_tokens, last.cached_tokens
            self._end(rid, Finish(last.finish, *counts, self.record.take(rid)),
                      Finish(last.finish, *counts, tokens))

    def stage_error(self, request_id: str, error: Error) -> None:
        self._stage_rest(request_id)
        self._end(request_id, error, error)

    def _stage_rest(self, request_id: str) -> None:
        """A request's unrecorded tokens, into its record now."""
        rest = self.record.take(request_id)
        if rest is not None:
            self._staged.records.append((request_id, rest))

    def stage_running(self, request_id: str, trace: str | None = None) -> None:
        """The request runs here (`trace`: its span here, when traced: worker/broker/spans.py)."""
        self._staged.running.append((request_id, trace))

    def lost_streams(self) -> None:
        """Redis may have lost keys (a restart): set the TTL again on each stream's next
        entry."""
        self._streams.clear()

    async def flush(self, *, batch_now: bool = False) -> None:
        """Retry the outbox, then send what is staged, in one pipeline (with the batch of
        acks when due, or with `batch_now`). On a Redis error what must not be lost is kept
        for the next flush, and the error is raised."""
        staged, self._staged = self._staged, Staged()
        now = time.monotonic()
        staged.records += self.record.due(now)
        if batch_now or now - self._batch_sent >= BATCH_S:
            staged.acks += self._batch.acks
            self._batch, self._batch_sent = Staged(), now
        if self._outbox:
            try:
                await self._retry_outbox()
            except aioredis.RedisError:
                self._failed(staged)
                raise
        if not staged:
            return
        try:
            await self._send(staged)
        except aioredis.RedisError:
            self._failed(staged)
            raise
        if self.metrics is not None:
            self.metrics.published(((request_id, fields["ids"].count(",") + 1)
                                    for request_id, fields in staged.live), time.time())
        self._written(staged.endings)
        if batch_now and self._batch:  # what those endings freed, now rather than later
            await self.flush(batch_now=True)

    def reassert_recent(self) -> None:
        """After a failover or an outage: the endings written in the last `RECENT_S` go to
        the outbox, to be added again to every record that does not end with one (a lost
        write), and their entries acknowledged again (a lost XACK would leave the request
        pending, for another worker to claim and run again)."""
        now = time.monotonic()
        for at, ending, entry_id in self._recent:
            if now - at > RECENT_S:
                continue
            self._outbox.endings.append(dataclasses.replace(ending, clock=None, again=True))
            if entry_id is not None:
                self._outbox.acks.append(entry_id)
        self._recent.clear()
        self.lost_streams()

    def _failed(self, staged: Staged) -> None:
        staged.keep_for_retry(self._outbox)
        self.lost_streams()

    def forget(self, taken: set[str]) -> None:
        """After an outage: drop the requests whose entries another worker claimed meanwhile
        (they are its to end)."""
        gone = {rid for rid, eid in self.entry_ids.items() if eid in taken}
        self.entry_ids = {rid: eid for rid, eid in self.entry_ids.items() if rid not in gone}
        if self.metrics is not None:
            self.metrics.taken_by_others(gone)
        self._outbox.drop(gone)
        self._staged.drop(gone)

    async def _send(self, staged: Staged) -> None:
        if time.monotonic() - self._clock_read > CLOCK_S:
            seconds, micros = await self.redis.time()
            self._clock_offset = seconds + micros / 1e6 - time.time()
            self._clock_read = time.monotonic()
        ttl = self.settings.request_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        for request_id, trace in staged.running:
            state_key = self.keys.state(request_id)
            pipe.hset(state_key,
                      mapping=RequestHash.running(self.name, trace))  # type: ignore[arg-type]
            pipe.expire(state_key, ttl)
        self._stage_records(pipe, staged.records)
        finished_ttl = self.settings.finished_ttl_s
        for ending in staged.endings:
            self._streams.discard(ending.request_id)
            out_key = self.keys.out(ending.request_id)
            state_key = self.keys.state(ending.request_id)
            pipe.xadd(out_key, ending.fields)  # type: ignore[arg-type]
            pipe.expire(out_key, finished_ttl)
            pipe.hset(state_key, mapping=ending.state)  # type: ignore[arg-type]
            pipe.expire(state_key, finished_ttl)
            # Its flags (if set) expire with them. After the hash's EXPIRE: a flag set from
            # then on takes the hash's remaining TTL (shared/scripts/request_flag.py).
            pipe.expire(self.keys.abort(ending.request_id), finished_ttl)
            pipe.expire(self.keys.resumed(ending.request_id), finished_ttl)
        self._stage_feeds(pipe, [*staged.live, *((e.request_id, e.live.to_fields())
                                                for e in staged.endings)])
        self._stage_acks(pipe, staged)
        await pipe.execute()

    def _stage_records(self, pipe: aioredis.client.Pipeline,
                       records: list[tuple[str, Tokens]]) -> None:
        ttl = self.settings.request_ttl_s
        for request_id, tokens in records:
            out_key = self.keys.out(request_id)
            pipe.xadd(out_key, tokens.to_fields())  # type: ignore[arg-type]
            if request_id not in self._streams:
                self._streams.add(request_id)
                pipe.expire(out_key, ttl)

    def _stage_feeds(self, pipe: aioredis.client.Pipeline,
                     entries: list[tuple[str, dict[str, str]]]) -> None:
        """After the result streams' entries: one feed entry per replica (a second one only
        for a request with two entries in this batch). NOMKSTREAM: a replica that is gone
        has no feed, and none is made for it."""
        feeds: dict[str, list[dict[str, dict[str, str]]]] = {}
        min_id = feed_min_id(time.time() + self._clock_offset)
        for request_id, fields in entries:
            batches = feeds.setdefault(replica_of(request_id), [{}])
            if request_id in batches[-1]:
                batches.append({})
            batches[-1][request_id] = fields
        for replica, batches in feeds.items():
            for batch in batches:
                pipe.xadd(self.keys.feed(replica), feed_fields(batch),  # type: ignore[arg-type]
                          minid=min_id, approximate=True, nomkstream=True)

    def _stage_acks(self, pipe: aioredis.client.Pipeline, staged: Staged) -> None:
        for batch in _chunks(staged.acks):
            pipe.xack(self.requests_key, WORKER_GROUP, *batch)
            pipe.xdel(self.requests_key, *batch)
        reclaim_ms = 2 * self.settings.heartbeat_ttl_s * 1000
        for request_id, entry_id in staged.hand_backs:
            pipe.xclaim(self.requests_key, WORKER_GROUP, self.name, 0, [entry_id],
                        idle=reclaim_ms + 1000, justid=True)
            state_key = self.keys.state(request_id)
            pipe.hset(state_key, mapping=RequestHash.handed_back())  # type: ignore[arg-type]
            pipe.expire(state_key, self.settings.request_ttl_s)

    async def _retry_outbox(self) -> None:
        outbox, now = self._outbox, time.time()
        expired = [e for e in outbox.endings if e.expires < now]
        for ending in expired:  # its keys are gone by now: nothing left to end
            self.entry_ids.pop(ending.request_id, None)
            if self.metrics is not None:
                self.metrics.gave_up(ending.request_id)
        outbox.endings = [e for e in outbox.endings if e.expires >= now]
        # A request's chunks go with its terminal entry, if it has one, so that a retry never
        # adds one after it; the others first.
        ending_ids = {e.request_id for e in outbox.endings}
        chunks: dict[str, list[dict[str, str]]] = {}
        for request_id, tokens in outbox.records:
            if request_id in ending_ids:
                chunks.setdefault(request_id, []).append(tokens.to_fields())
        running = [r for r in outbox.records if r[0] not in ending_ids]
        if running:
            pipe = self.redis.pipeline(transaction=False)
            self._stage_records(pipe, running)
            await pipe.execute()
        outbox.records = [r for r in outbox.records if r[0] in ending_ids]
        # One script call each (a rare path; a Cluster pipeline cannot carry scripts), then
        # the feed learns of those that were added.
        added = []
        for e in outbox.endings:
            reply = await self._terminal_once(
                TerminalKeys(self.keys.out(e.request_id), self.keys.state(e.request_id),
                             self.keys.abort(e.request_id), self.keys.resumed(e.request_id)),
                TerminalArgs(self.settings.finished_ttl_s, e.fields, e.state,
                             chunks.get(e.request_id, [])))
            if reply is Terminal.ADDED:
                added.append((e.request_id, e.fields))
        pipe = self.redis.pipeline(transaction=False)
        self._stage_feeds(pipe, added)
        self._stage_acks(pipe, outbox)
        await pipe.execute()
        self._outbox = Staged()
        self._written(outbox.endings)

    def _written(self, endings: list[Ending]) -> None:
        """Terminal entries now in Redis: their requests' stream entries are done."""
        now, clock = time.time(), time.monotonic()
        for ending in endings:
            entry_id = self.entry_ids.pop(ending.request_id, None)
            if entry_id is not None:
                self._batch.acks.append(entry_id)
            if ending.again:  # counted when it was first written
                continue
            self._recent.append((clock, ending, entry_id))
            while clock - self._recent[0][0] > RECENT_S:
                self._recent.popleft()
            if self.metrics is not None:
                entry, live = ending.entry, ending.live
                if isinstance(entry, Finish):
                    carried = (len(live.tokens.ids)
                               if isinstance(live, Finish) and live.tokens is not None else 0)
                    self.metrics.ended(ending.request_id, ending.clock, entry.finish_reason,
                                       entry.completion_tokens, carried, now)
                else:
                    self.metrics.ended(ending.request_id, ending.clock, entry.code, None, 0, now)

    def _end(self, request_id: str, entry: Finish | Error, live: Finish | Error) -> None:
        clock = None if self.metrics is None else self.metrics.ending(request_id)
        expires = self._expires.pop(request_id, time.time() + self.settings.request_ttl_s)
        self._staged.endings.append(Ending(request_id, entry, live, expires, clock))


def _tokens(group: list[StepOutput]) -> Tokens | None:
    """The tokens shown of one request's outputs (a stop token is not), as one entry."""
    shown = [(o, o.token) for o in group if o.token is not None]
    if not shown:
        return None
    first = shown[0][0]
    logprobs = tuple(o.logprob for o, _ in shown if o.logprob is not None)
    return Tokens(first.index, tuple(t for _, t in shown),
                  logprobs if len(logprobs) == len(shown) else None,
                  None if first.queued_s is None else round(first.queued_s * 1000))


def _by_request(outputs: Iterable[StepOutput]) -> list[list[StepOutput]]:
    """Runs of consecutive outputs of one request, in order."""
    groups: list[list[StepOutput]] = []
    for out in outputs:
        if groups and groups[-1][-1].request_id == out.request_id and groups[-1][-1].finish is None:
            groups[-1].append(out)
        else:
            groups.append([out])
    return groups


def _chunks(items: list[str], size: int = 512) -> list[list[str]]:
    return [items[i:i + size] for i in range(0, len(items), size)]
