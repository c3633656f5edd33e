"""A request's result entries (its result stream and its replica's feed): tokens, then
exactly one finish or error. Flat string fields, so `redis-cli XRANGE` reads them.

The feed carries every step's tokens as they come; the result stream is the record, written in
chunks (worker/broker/record.py), so one entry there may hold many tokens. A reply is rendered one
token at a time (`Tokens.split`, api/render/walk.py), so it is the same from either.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from shared.messages.requests import FinishReason

TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]  # chosen, then top alternatives


@dataclass(frozen=True)
class Tokens:
    index: int
    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    # On a request's first token: how long it waited for a worker (created -> admitted), which
    # only the worker knows and the replica's queue-time histogram reports.
    queued_ms: int | None = None

    def to_fields(self) -> dict[str, str]:
        fields = {"kind": "tokens", "index": str(self.index), "ids": ",".join(map(str, self.ids))}
        if self.logprobs is not None:
            fields["logprobs"] = orjson.dumps(self.logprobs).decode()
        if self.queued_ms is not None:
            fields["queued_ms"] = str(self.queued_ms)
        return fields

    @property
    def end(self) -> int:
        """The index just past these tokens."""
        return self.index + len(self.ids)

    def split(self) -> list[Tokens]:
        """One entry per token (the first keeps `queued_ms`)."""
        if len(self.ids) == 1:
            return [self]
        return [Tokens(self.index + i, (token,),
                       None if self.logprobs is None else (self.logprobs[i],),
                       self.queued_ms if i == 0 else None)
                for i, token in enumerate(self.ids)]

    @classmethod
    def joined(cls, parts: list[Tokens]) -> Tokens:
        """Consecutive entries as one (logprobs kept only if every part has them)."""
        logprobs = None
        if all(p.logprobs is not None for p in parts):
            logprobs = tuple(lp for p in parts for lp in p.logprobs or ())
        return cls(parts[0].index, tuple(t for p in parts for t in p.ids), logprobs,
                   parts[0].queued_ms)


@dataclass(frozen=True)
class Finish:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prefix cache
    tokens: Tokens | None = None  # the last tokens, published with the finish

    def to_fields(self) -> dict[str, str]:
        last = self.tokens.to_fields() if self.tokens is not None else {}
        return {
            **last,
            "kind": "finish",
            "finish_reason": self.finish_reason,
            "prompt_tokens": str(self.prompt_tokens),
            "completion_tokens": str(self.completion_tokens),
            "cached_tokens": str(self.cached_tokens),
        }


@dataclass(frozen=True)
class Error:
    message: str
    type: str = "server_error"
    code: str = "internal_error"

    def to_fields(self) -> dict[str, str]:
        return {"kind": "error", "type": self.type, "code": self.code, "message": self.message}


ResultEntry = Tokens | Finish | Error


def _tokens(f: dict[str, str]) -> Tokens:
    ids = tuple(int(x) for x in f["ids"].split(",")) if f["ids"] else ()
    logprobs = None
    if "logprobs" in f:
        logprobs = tuple((float(lp), tuple((int(t), float(v)) for t, v in top))
                         for lp, top in orjson.loads(f["logprobs"]))
    queued_ms = int(f["queued_ms"]) if "queued_ms" in f else None
    return Tokens(index=int(f["index"]), ids=ids, logprobs=logprobs, queued_ms=queued_ms)


# How long a replica's feed keeps its entries (trimmed by entry id, i.e. time). The feed holds
# the tokens not yet in a request's record: what a worker taking over a dead worker's request
# reads back (worker/broker/recovery.py), so this spans the takeover delay (twice the heartbeat TTL)
# many times over (a takeover later than that cannot continue a sampled request: see
# worker/broker/recovery.py). Entries are trimmed by Redis's clock, which the ids carry.
FEED_RETENTION_S = 120


def feed_min_id(now: float) -> str:
    """The XADD MINID that keeps `FEED_RETENTION_S` of a feed; `now` on Redis's clock."""
    return f"{int((now - FEED_RETENTION_S) * 1000)}-0"


# A feed entry's one field: the JSON of {request id: that request's result entry}. One field of
# the same name in every entry: Redis stores and replies it far more cheaply than a field per
# request (measured: a step's feed XADD and XREAD cost half as much).
FEED_FIELD = "d"


def feed_fields(entries: dict[str, dict[str, str]]) -> dict[str, str]:
    """A feed entry carrying `entries` (see `FEED_FIELD`)."""
    return {FEED_FIELD: orjson.dumps(entries).decode()}


def feed_marker() -> dict[str, str]:
    """The entry a replica makes its feed with: it carries no request's entry."""
    return {FEED_FIELD: ""}


def feed_payload(fields: dict[bytes, bytes]) -> bytes:
    """A feed entry's JSON, undecoded: a request id can be looked for in it before any
    decoding."""
    return fields.get(FEED_FIELD.encode(), b"")


def decode_feed(fields: dict[bytes, bytes]) -> dict[str, dict[str, str]]:
    """A feed entry's request entries (a replica's own marker entry has none)."""
    payload = feed_payload(fields)
    return orjson.loads(payload) if payload else {}


def decode_result(fields: dict[bytes, bytes] | dict[str, str]) -> ResultEntry:
    f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in fields.items()}
    kind = f.get("kind")
    if kind == "tokens":
        return _tokens(f)
    if kind == "finish":
        reason = f["finish_reason"]
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason {reason!r}")
        return Finish(reason, int(f["prompt_tokens"]), int(f["completion_tokens"]),  # type: ignore[arg-type]
                      int(f.get("cached_tokens", "0")), _tokens(f) if "ids" in f else None)
    if kind == "error":
        return Error(message=f["message"], type=f["type"], code=f["code"])
    raise ValueError(f"unknown result entry kind {kind!r}")


def queue_timeout(model: str) -> Error:
    """How a request no worker took in time ends while the model has live workers (from the
    API, or a worker that takes it late)."""
    return Error(f"no worker for model {model!r} took the request within its queue deadline: "
                 "all of its workers are busy", "server_error", "queue_timeout")


def no_worker(model: str) -> Error:
    """How a request ends, on its API replica, when its model has had no live worker for the
    queue deadline: queued, or held by a worker that died and that no other took over."""
    return Error(f"the model {model!r} has no live worker: none took the request, or took "
                 "it over from a worker that stopped, within the queue deadline; retry later",
                 "server_error", "no_worker")


def expand(entry: ResultEntry) -> list[ResultEntry]:
    """A finish entry that carries tokens, as the tokens entry then the finish."""
    if isinstance(entry, Finish) and entry.tokens is not None:
        return [entry.tokens, Finish(entry.finish_reason, entry.prompt_tokens,
                                     entry.completion_tokens, entry.cached_tokens)]
    return [entry]


def is_terminal(fields: dict[bytes, bytes]) -> bool:
    return fields.get(b"kind") in (b"finish", b"error")

