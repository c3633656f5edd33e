"""One read-only snapshot of a deployment: its requests in flight, its models, its workers.

What a request is doing is read from its keys alone (see `request_state` for the rules), so
the snapshot needs no replica or worker to answer. Everything is read in pipelines of at most
`BATCH` requests, each command touching one key: on Redis Cluster the pipeline routes them
node by node, and nothing needs two slots at once. A request hash is read with HMGET of the
fields shown, never HGETALL: the hash of a resumable stream holds its whole rendering state
(echoed prompt included). Only the requests listed (`limit`, oldest first) cost more commands
(their abort and resumed keys, the last entry of their result stream); the rest are counted.
A key that does not hold what redserve writes there (a heartbeat that is not JSON, a count that
is not a number) is listed as unreadable, with what is wrong, and the rest is shown as usual:
an operator's view must not fail on the one key that needs looking at. A tenant's rate-limit
bucket is shown as it stands now: its stored levels refilled to Redis's clock (one TIME), as
the admission script would see them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from ops.inspector import stored
from ops.inspector.keyspace import batched, text, walk
from shared.keys import QUEUE_STALE_MARGIN_S, QUEUED_CONSUMER, WORKER_GROUP, Keys, replica_of
from shared.messages import (
    Bucket,
    BucketField,
    Finish,
    Heartbeat,
    RequestField,
    RequestHash,
    RequestState,
    ServiceCounters,
    Tokens,
    decode_result,
)

HASH_FIELDS = (RequestField.STATE, RequestField.MODEL, RequestField.TENANT, RequestField.CREATED,
               RequestField.PROMPT_TOKENS, RequestField.WORKER, RequestField.STREAMING,
               RequestField.DETACHED)
FINISHED = frozenset({RequestState.DONE, RequestState.ABORTED, RequestState.ERROR})


@dataclass(frozen=True)
class RequestView:
    id: str
    model: str
    tenant: str
    state: str  # queued | running | streaming | resumable | cancelling (see request_state)
    age_s: float
    prompt_tokens: int
    generated_tokens: int | None  # None: its result stream's last entry is unreadable
    worker: str | None  # None while queued
    replica: str  # the accepting replica's tag, the id's `<R>-` part


@dataclass(frozen=True)
class ModelView:
    name: str
    queued: int  # places taken in the bounded queue (its queued set, stale members left out)
    stream_length: int  # entries in the request stream: requests not finished yet
    # Entries no worker has taken yet: waiting in the queue (pending under the queue's own
    # consumer, see shared/keys.py) or not read at all (None: Redis cannot tell).
    lag: int | None
    pending: int  # entries a worker has taken and not yet acknowledged
    live_workers: tuple[str, ...]  # heartbeat current and not draining
    # Per tenant, the tokens it has been served, divided by its weight: the fair share's
    # service counters (shared/messages/queue.py), least served first.
    served: dict[str, float]


@dataclass(frozen=True)
class WorkerView:
    name: str
    model: str
    heartbeat_age_s: float | None  # None: a worker too old to say when it beat
    running: int
    waiting: int
    capacity: int
    kv_pages_used: int
    kv_pages_free: int  # free or held only by the prefix cache
    kv_pages_total: int
    tokens_per_s: float | None
    device: str
    dtype: str
    draining: bool
    prefix_pages: int = 0  # full pages its prefix cache can serve (what placement sees)
    draft_acceptance: float | None = None  # speculative decoding since start (None: no drafts)
    tokens_per_step: float | None = None  # a request's tokens per step (None: no steps yet)
    # How it computes, as its heartbeat says ("", None, 0: a worker too old to say).
    kernels: str = ""
    batch_invariant: bool | None = None
    threads: int = 0  # the most CPU threads a step uses (0: none apply, a GPU worker; or not said)
    decode_threads: int = 0  # pinned in steps under 256 tokens (0: chosen by measurement)
    threads_last: int = 0  # those of its latest step
    loras: tuple[str, ...] = ()  # the LoRA adapters it holds, least recently used first


@dataclass(frozen=True)
class LimitView:
    """A tenant's rate limits on one model, now (a tenant with none used this minute: not
    listed, its buckets are full)."""

    model: str
    tenant: str
    requests_remaining: int | None  # None: no requests limit
    requests_limit: int
    tokens_remaining: int | None  # None: no tokens limit
    tokens_limit: int


@dataclass(frozen=True)
class Unreadable:
    """A key that does not hold what redserve writes there, and what is wrong with it."""

    key: str
    problem: str


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    key_prefix: str
    model_filter: str | None
    in_flight: int  # requests not finished, listed or not (unreadable ones aside)
    omitted: int  # of those, not listed (past the limit)
    finished: int  # finished requests whose keys have not expired yet
    requests: tuple[RequestView, ...]  # oldest first
    models: tuple[ModelView, ...]
    workers: tuple[WorkerView, ...]
    limits: tuple[LimitView, ...]  # by model, then tenant
    stored_responses: stored.StoredResponses  # of every model, whatever `--model` says
    unreadable: tuple[Unreadable, ...]  # keys that do not hold what redserve writes there


@dataclass(frozen=True)
class _Live:
    """An unfinished request whose hash reads as numbers where it should."""

    id: str
    record: RequestHash


def request_state(state: str, *, streaming: bool, detached: bool, aborted: bool,
                  resumed: bool) -> str:
    """What an unfinished request is doing, from its keys:
    - cancelling: its abort key is set; a worker drops it at intake or at the next step;
    - queued: its hash says `queued`: no worker has taken it (or one handed it back);
    - resumable: a stream whose client went away (`detached` in its hash, written when the
      replica leaves it running for REDSERVE_RESUME_GRACE_S) and no client resumed it (no
      `resumed` key): it runs on and can be resumed from any replica;
    - streaming: a worker runs it and a client reads its SSE stream (the first client, or
      one that resumed it);
    - running: a worker runs it for one JSON reply."""
    if aborted:
        return "cancelling"
    if state == RequestState.QUEUED:
        return "queued"
    if streaming:
        return "resumable" if detached and not resumed else "streaming"
    return "running"


async def take(redis: aioredis.Redis, keys: Keys, *, queue_timeout_s: float,
               model: str | None = None, limit: int = 200) -> Snapshot:
    """`queue_timeout_s`: the deployment's REDSERVE_QUEUE_TIMEOUT_S, which says which queued
    entries are stale."""
    found = await walk(redis, keys)
    now = time.time()
    ids = sorted(found.request_ids)
    hashes = await batched(redis, ids, 1, lambda p, i: p.hmget(keys.state(i), HASH_FIELDS))
    fields = [dict(zip(HASH_FIELDS, [None if v is None else text(v)
                                     for v in values or [None] * len(HASH_FIELDS)],
                       strict=True)) for [values] in hashes]
    mine = [(i, f) for i, f in zip(ids, fields, strict=True)
            if f[RequestField.STATE] is not None
            and (model is None or f[RequestField.MODEL] == model)]
    live: list[_Live] = []
    unreadable: list[Unreadable] = []
    for request_id, f in mine:
        if f[RequestField.STATE] in FINISHED:
            continue
        try:
            live.append(_Live(request_id, RequestHash.decode(f)))
        except ValueError as e:
            unreadable.append(Unreadable(keys.state(request_id), str(e)))
    live.sort(key=lambda r: (r.record.created, r.id))
    listed = live[:limit]
    requests = await _requests(redis, keys, listed, now, unreadable)
    workers = await _workers(redis, keys, sorted(found.workers), model, now, unreadable)
    names = {model} if model else (found.models | {w.model for w in workers}
                                   | {m for _, f in mine if (m := f[RequestField.MODEL])})
    finished = sum(f[RequestField.STATE] in FINISHED for _, f in mine)
    return Snapshot(
        taken_at=round(now, 3), key_prefix=keys.prefix, model_filter=model,
        in_flight=len(live), omitted=len(live) - len(listed), finished=finished,
        requests=tuple(requests),
        models=tuple(await _models(redis, keys, sorted(names), now - queue_timeout_s
                                   - QUEUE_STALE_MARGIN_S, now)),
        workers=tuple(workers),
        limits=tuple(await _limits(redis, keys, sorted(found.limits), model, unreadable)),
        stored_responses=await stored.read(redis, keys, sorted(found.responses)),
        unreadable=tuple(unreadable))


async def _requests(redis: aioredis.Redis, keys: Keys, listed: list[_Live], now: float,
                    unreadable: list[Unreadable]) -> list[RequestView]:
    def stage(pipe: Any, item: _Live) -> None:
        pipe.exists(keys.abort(item.id))
        pipe.exists(keys.resumed(item.id))
        pipe.xrevrange(keys.out(item.id), "+", "-", count=1)

    views = []
    for r, (aborted, resumed, last) in zip(listed, await batched(redis, listed, 3, stage),
                                           strict=True):
        record = r.record
        state = request_state(record.state, streaming=record.streaming,
                              detached=record.detached is not None, aborted=bool(aborted),
                              resumed=bool(resumed))
        try:
            generated: int | None = _generated(last)
        except ValueError as e:
            generated = None
            unreadable.append(Unreadable(keys.out(r.id), str(e)))
        views.append(RequestView(
            id=r.id, model=record.model, tenant=record.tenant, state=state,
            age_s=round(max(now - record.created, 0.0), 1), prompt_tokens=record.prompt_tokens,
            generated_tokens=generated,
            worker=record.worker if record.state == RequestState.RUNNING else None,
            replica=replica_of(r.id)))
    return views


def _generated(last: list[tuple[bytes, dict[bytes, bytes]]] | None) -> int:
    """Tokens published so far, from the result stream's last entry: a token entry (and a
    finish that carries the last tokens) holds the position of its first token and its ids;
    a bare finish holds the count. ValueError for an entry that holds no such numbers."""
    if not last:
        return 0  # no stream yet, or a key of another type (its command failed)
    try:
        entry = decode_result(last[0][1])
    except (KeyError, TypeError, ValueError):  # not an entry redserve writes
        raise ValueError(f"its last entry ({text(last[0][0])}) holds no token count") from None
    if isinstance(entry, Finish):
        entry = entry.tokens or entry
    if isinstance(entry, Tokens):
        return entry.index + len(entry.ids)
    return entry.completion_tokens if isinstance(entry, Finish) else 0


async def _workers(redis: aioredis.Redis, keys: Keys, names: list[str], model: str | None,
                   now: float, unreadable: list[Unreadable]) -> list[WorkerView]:
    bodies = await batched(redis, names, 1, lambda p, n: p.get(keys.worker(n)))
    views = []
    for name, [raw] in zip(names, bodies, strict=True):
        if raw is None:
            continue  # its heartbeat expired since the walk (or is a key of another type)
        try:
            view = _worker_view(name, raw, now)
        except ValueError as e:
            unreadable.append(Unreadable(keys.worker(name), str(e)))
            continue
        if model is None or view.model == model:
            views.append(view)
    return views


def _worker_view(name: str, raw: bytes, now: float) -> WorkerView:
    """A worker's heartbeat, or ValueError saying what is wrong with it."""
    beat = Heartbeat.from_json(raw)
    return WorkerView(
        name=name, model=beat.model,
        heartbeat_age_s=None if beat.at is None else round(max(now - beat.at, 0.0), 1),
        running=beat.running, waiting=beat.waiting, capacity=beat.capacity,
        kv_pages_used=beat.pages_used, kv_pages_free=beat.kv_pages_free,
        kv_pages_total=beat.kv_pages_total, tokens_per_s=beat.tokens_per_s, device=beat.device,
        dtype=beat.dtype, draining=beat.draining, prefix_pages=beat.prefix_pages,
        draft_acceptance=(round(beat.draft_tokens_accepted / beat.draft_tokens, 3)
                          if beat.draft_tokens else None),
        tokens_per_step=(round(beat.request_step_tokens / beat.request_steps, 2)
                         if beat.request_steps else None),
        kernels=beat.kernels, batch_invariant=beat.batch_invariant, threads=beat.threads,
        decode_threads=beat.decode_threads, threads_last=beat.threads_last, loras=beat.loras)


async def _models(redis: aioredis.Redis, keys: Keys, names: list[str], fresh_since: float,
                  now: float) -> list[ModelView]:
    def stage(pipe: Any, name: str) -> None:
        pipe.zcount(keys.queued(name), fresh_since, "+inf")
        pipe.xlen(keys.requests(name))
        pipe.xinfo_groups(keys.requests(name))
        pipe.zrangebyscore(keys.workers(name), now, "+inf")
        pipe.xinfo_consumers(keys.requests(name), WORKER_GROUP)
        pipe.hgetall(keys.service(name))

    views = []
    for name, (queued, length, groups, live, consumers, served) in zip(
            names, await batched(redis, names, 6, stage), strict=True):
        # No stream yet (or it expired with its last worker): no groups.
        group = next((g for g in groups or [] if text(g["name"]) == WORKER_GROUP), None)
        waiting = sum(int(c["pending"]) for c in consumers or []
                      if text(c["name"]) == QUEUED_CONSUMER)
        counters = ServiceCounters.decode(served or {}).by_tenant
        views.append(ModelView(
            name=name, queued=int(queued or 0), stream_length=int(length or 0),
            lag=None if group is None or group.get("lag") is None
            else int(group["lag"]) + waiting,
            pending=0 if group is None else int(group["pending"]) - waiting,
            live_workers=tuple(sorted(text(n) for n in live or [])),
            served=dict(sorted(counters.items(), key=lambda kv: kv[1]))))
    return views


async def _limits(redis: aioredis.Redis, keys: Keys, buckets: list[tuple[str, str]],
                  model: str | None, unreadable: list[Unreadable]) -> list[LimitView]:
    mine = [b for b in buckets if model is None or b[0] == model]
    if not mine:
        return []
    seconds, micros = await redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    replies = await batched(redis, mine, 1, lambda p, b: p.hmget(keys.limits(*b),
                                                                   list(BucketField)))
    views = []
    for (name, tenant), [values] in zip(mine, replies, strict=True):
        if values is None or all(v is None for v in values):
            continue  # expired since the walk (full again), or a key of another type
        try:
            bucket = Bucket.decode(dict(zip(BucketField, [None if v is None else text(v)
                                                          for v in values], strict=True)))
        except ValueError as e:
            unreadable.append(Unreadable(keys.limits(name, tenant), str(e)))
            continue
        now = bucket.at(now_ms)
        views.append(LimitView(
            model=name, tenant=tenant,
            requests_remaining=int(now.requests) if now.requests_limit else None,
            requests_limit=now.requests_limit,
            tokens_remaining=int(now.tokens) if now.tokens_limit else None,
            tokens_limit=now.tokens_limit))
    return views
