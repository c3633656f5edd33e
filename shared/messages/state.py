"""A request's hash: its state and counts, written in parts by the replica that accepts it
and the worker that runs it, read by any replica (cancel, resume) and `redserve inspect`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from shared.messages.results import Error, Finish


class RequestState:
    """Values of the `state` field of a request's hash (see `shared.keys`)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"
    ERROR = "error"


class RequestField(StrEnum):
    """The fields of a request's hash (`shared.keys`: `{prefix}:{<replica>}:<id>`). Written in
    parts, each by the party that knows it: the accepting replica (`RequestHash.to_fields`),
    the worker (`RequestHash.running`, `.ended`, `.handed_back`) and the replica again when a
    stream's client leaves (`RequestHash.detached_at`). Flat strings, so `redis-cli HGETALL`
    reads it."""

    STATE = "state"  # a `RequestState`
    MODEL = "model"  # the served model's name
    TENANT = "tenant"  # whose it is: only that tenant may cancel or resume it
    CREATED = "created"  # unix time the replica accepted it
    PROMPT_TOKENS = "prompt_tokens"
    REPLICA = "replica"  # the accepting replica's tag
    CHOICES = "choices"  # choices of its reply: `<id>`, `<id>-1` .. `<id>-<n-1>`
    STREAMING = "streaming"  # 1: answered with SSE, 0: one JSON reply
    STREAM = "stream"  # a resumable stream's rendering state (JSON, `api.queue.replay.StreamView`)
    WORKER = "worker"  # the worker running it (from `running` on)
    DETACHED = "detached"  # unix time its stream's client left under the resume grace
    COMPLETION_TOKENS = "completion_tokens"  # once finished
    FINISH_REASON = "finish_reason"  # once finished (not on an error)
    # Only for a traced request (shared/tracing.py): the W3C `traceparent` of the replica's
    # span (a resume links to it) and of its worker's (a takeover links to it).
    TRACE = "trace"
    WORKER_TRACE = "worker_trace"


@dataclass(frozen=True)
class RequestHash:
    """A request's hash, decoded. Only `state` is always there; the rest is what its writers
    have written so far (see `RequestField`)."""

    state: str
    model: str = ""
    tenant: str = ""
    created: float = 0.0
    prompt_tokens: int = 0
    replica: str = ""
    choices: int = 1
    streaming: bool = False
    stream: str | None = None
    worker: str | None = None
    detached: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    trace: str | None = None
    worker_trace: str | None = None

    def to_fields(self) -> dict[str, str]:
        """The fields an accepting replica writes (the worker's come later)."""
        fields = {
            RequestField.STATE: self.state,
            RequestField.MODEL: self.model,
            RequestField.CREATED: f"{self.created:.3f}",
            RequestField.PROMPT_TOKENS: str(self.prompt_tokens),
            RequestField.REPLICA: self.replica,
            RequestField.TENANT: self.tenant,
            RequestField.CHOICES: str(self.choices),
            RequestField.STREAMING: "1" if self.streaming else "0",
        }
        if self.stream is not None:
            fields[RequestField.STREAM] = self.stream
        if self.trace is not None:
            fields[RequestField.TRACE] = self.trace
        return _plain(fields)

    @staticmethod
    def running(worker: str, trace: str | None = None) -> dict[str, str]:
        """A worker took it (`trace`: its span there, when traced)."""
        fields = {RequestField.STATE: RequestState.RUNNING, RequestField.WORKER: worker}
        if trace is not None:
            fields[RequestField.WORKER_TRACE] = trace
        return _plain(fields)

    @staticmethod
    def handed_back() -> dict[str, str]:
        """A draining worker gave it back for another to take."""
        return _plain({RequestField.STATE: RequestState.QUEUED})

    @staticmethod
    def ended(entry: Finish | Error) -> dict[str, str]:
        """Its terminal entry was written: a finish (with its counts) or an error."""
        if isinstance(entry, Error):
            return _plain({RequestField.STATE: RequestState.ERROR})
        state = RequestState.ABORTED if entry.finish_reason == "abort" else RequestState.DONE
        return _plain({RequestField.STATE: state,
                       RequestField.COMPLETION_TOKENS: str(entry.completion_tokens),
                       RequestField.FINISH_REASON: entry.finish_reason})

    @staticmethod
    def detached_at(at: float) -> dict[str, str]:
        """Its stream's client went away; it runs on for a resume."""
        return _plain({RequestField.DETACHED: f"{at:.3f}"})

    @classmethod
    def decode(cls, raw: Mapping[bytes, bytes | None] | Mapping[str, str | None]
               | Mapping[RequestField, str | None]) -> RequestHash:
        """From an HGETALL reply, or HMGET's as {field: value}. ValueError naming the field for
        a hash with no state or with a number field that is not a number."""
        f = {as_text(k): as_text(v) for k, v in raw.items() if v is not None}
        state = f.get(RequestField.STATE)
        if state is None:
            raise ValueError("no state field")

        def number(name: RequestField) -> float | None:
            value = f.get(name)
            if not value:
                return None
            try:
                parsed = float(value)
            except ValueError:
                parsed = math.nan
            if not math.isfinite(parsed):
                raise ValueError(f"field {str(name)!r} is not a number: {value!r}")
            return parsed

        def count(name: RequestField) -> int | None:
            value = number(name)
            return None if value is None else int(value)

        return cls(
            state=state, model=f.get(RequestField.MODEL, ""), tenant=f.get(RequestField.TENANT, ""),
            created=number(RequestField.CREATED) or 0.0,
            prompt_tokens=count(RequestField.PROMPT_TOKENS) or 0,
            replica=f.get(RequestField.REPLICA, ""), choices=count(RequestField.CHOICES) or 1,
            streaming=f.get(RequestField.STREAMING) == "1", stream=f.get(RequestField.STREAM),
            worker=f.get(RequestField.WORKER), detached=number(RequestField.DETACHED),
            completion_tokens=count(RequestField.COMPLETION_TOKENS),
            finish_reason=f.get(RequestField.FINISH_REASON), trace=f.get(RequestField.TRACE),
            worker_trace=f.get(RequestField.WORKER_TRACE))


def _plain(fields: dict[RequestField, str]) -> dict[str, str]:
    """Keys as plain strings (JSON encoders, orjson's among them, take no str subclass)."""
    return {str(k): v for k, v in fields.items()}


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

