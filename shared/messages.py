"""What travels through Redis.

Request stream entry: `{"id": <request id>, "body": <GenerateRequest JSON>}`.

Result stream entries (one stream per request, read by the API replica that owns the request):
    kind=tokens  index=<position of the first id>  ids=<comma-separated token ids>
                 [logprobs=<JSON: per token [logprob, [[id, logprob], ...top alternatives]]>]
                 [queued_ms=<created -> admitted by the worker; on a request's first token>]
    kind=finish  finish_reason=stop|length|abort  prompt_tokens=N  completion_tokens=N
                 cached_tokens=N  [index=.. ids=.. logprobs=..: the request's last tokens]
    kind=error   type=<error type>  code=<code>  message=<text>
Feed entry (one per worker step per replica, see `shared.keys`): `d=<JSON {<request id>: that
request's result entry fields}>` for each of the replica's requests the step produced.
Exactly one `finish` or `error` entry ends every result stream. A finish entry may carry the
tokens of the step that ended the request (one XADD instead of two: Redis commands per token
are the budget), read as a tokens entry followed by the finish (`expand`). Flat string fields
keep the streams readable with plain `redis-cli XRANGE`.

Request hash (`RequestField` names its fields, `RequestHash` writes and reads them): written in
parts, by the replica that accepts the request and by the worker that runs it; read by any
replica (cancel, resume) and by `redserve inspect`.
Heartbeat (`Heartbeat`): a worker's status as JSON, rewritten on every beat.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = no top-k cut
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities: None = none; N = the chosen token's and its N best alternatives.
    logprobs: int | None = Field(default=None, ge=0, le=20)
    min_tokens: int = Field(default=0, ge=0)  # no stop token before this many (vLLM's)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    model: str
    prompt_ids: tuple[int, ...] = Field(min_length=1)
    params: SamplingParams
    created: float
    queue_deadline: float  # unix time after which, if no worker took it, it ends untouched
    deadline: float  # unix time after which the request ends with an error entry
    tenant: str = ""  # the caller's tenant (see api.auth.keys): only it may cancel or resume
    # The output's grammar (`shared.grammar`), when constrained: JSON schema, regex, choice,
    # Lark grammar or tool calls, compiled by the replica into llguidance's grammar format.
    grammar: str | None = None
    trace_id: str = ""

    def to_fields(self) -> dict[str, str]:
        return {"id": self.id, "body": self.model_dump_json()}

    @property
    def queue_member(self) -> str:
        """Its member in the model's queued set: the id, the tenant whose share it takes (a
        tenant name has no colon) and the prompt size it reserves."""
        return f"{self.id}:{self.tenant}:{len(self.prompt_ids)}"

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> GenerateRequest:
        return cls.model_validate_json(fields[b"body"])


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


def feed_fields(entries: dict[str, dict[str, str]]) -> dict[str, str]:
    """A feed entry: one field `d`, the JSON of {request id: that request's result entry}. One
    field of the same name in every entry: Redis stores and replies it far more cheaply than a
    field per request (measured: a step's feed XADD and XREAD cost half as much)."""
    return {"d": orjson.dumps(entries).decode()}


def decode_feed(fields: dict[bytes, bytes]) -> dict[str, dict[str, str]]:
    """A feed entry's request entries (a replica's own marker entry has none)."""
    payload = fields.get(b"d")
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
    """How a request no worker took in time ends (from the API or a worker that takes it
    late)."""
    return Error(f"no worker for model {model!r} took the request within its queue deadline: "
                 "the model has no live worker, or all of them are busy", "server_error",
                 "queue_timeout")


def expand(entry: ResultEntry) -> list[ResultEntry]:
    """A finish entry that carries tokens, as the tokens entry then the finish."""
    if isinstance(entry, Finish) and entry.tokens is not None:
        return [entry.tokens, Finish(entry.finish_reason, entry.prompt_tokens,
                                     entry.completion_tokens, entry.cached_tokens)]
    return [entry]


def is_terminal(fields: dict[bytes, bytes]) -> bool:
    return fields.get(b"kind") in (b"finish", b"error")


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
    STREAM = "stream"  # a resumable stream's rendering state (JSON, `api.resume.StreamView`)
    WORKER = "worker"  # the worker running it (from `running` on)
    DETACHED = "detached"  # unix time its stream's client left under the resume grace
    COMPLETION_TOKENS = "completion_tokens"  # once finished
    FINISH_REASON = "finish_reason"  # once finished (not on an error)


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
        return _plain(fields)

    @staticmethod
    def running(worker: str) -> dict[str, str]:
        """A worker took it."""
        return _plain({RequestField.STATE: RequestState.RUNNING, RequestField.WORKER: worker})

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
        f = {_text(k): _text(v) for k, v in raw.items() if v is not None}
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
            finish_reason=f.get(RequestField.FINISH_REASON))


def _plain(fields: dict[RequestField, str]) -> dict[str, str]:
    """Keys as plain strings (JSON encoders, orjson's among them, take no str subclass)."""
    return {str(k): v for k, v in fields.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Heartbeat:
    """A worker's status key (`shared.keys`: `{prefix}:worker:<name>`), JSON, rewritten with a
    TTL on every beat (`worker.presence`): what `/health` and `redserve inspect` show of it.
    A field an older worker did not write reads as its default."""

    model: str = ""
    capacity: int = 0  # requests it may hold (--max-running)
    running: int = 0  # in the running batch
    waiting: int = 0  # taken, waiting for room in the batch
    kv_pages_used: int | None = None  # referenced by requests (None: total - free)
    kv_pages_free: int = 0  # empty, or held only by the prefix cache
    kv_pages_cached: int = 0  # held only by the prefix cache
    kv_pages_total: int = 0
    generated_tokens: int = 0  # since the worker started
    tokens_per_s: float | None = None  # over the interval since the previous beat
    at: float | None = None  # unix time of the beat: its age needs no knowledge of the TTL
    device: str = ""
    dtype: str = ""
    outbox: int = 0  # terminal entries waiting for Redis to come back
    draining: bool = False

    @property
    def pages_used(self) -> int:
        return (self.kv_pages_total - self.kv_pages_free if self.kv_pages_used is None
                else self.kv_pages_used)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        """ValueError saying what is wrong with a body that is not a heartbeat."""
        try:
            beat = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ValueError(f"heartbeat is not JSON: {_text(raw[:60])!r}") from None
        if not isinstance(beat, dict):
            raise ValueError(f"heartbeat is not a JSON object: {_text(raw[:60])!r}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in beat or (beat[f.name] is None and f.default is None):
                continue
            value, kind = beat[f.name], _HEARTBEAT_TYPES[f.name]
            if kind in (int, float, int | None, float | None):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"heartbeat field {f.name!r} is not a number: {value!r}")
                value = int(value) if kind in (int, int | None) else value
            else:
                value = bool(value) if kind is bool else str(value)
            values[f.name] = value
        return cls(**values)


_HEARTBEAT_TYPES = typing.get_type_hints(Heartbeat)
