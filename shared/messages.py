"""What travels through Redis.

Request stream entry: `{"id": <request id>, "body": <GenerateRequest JSON>}`.

Result stream entries (one stream per request, read by the API replica that owns the request):
    kind=tokens  index=<position of the first id>  ids=<comma-separated token ids>
                 [logprobs=<JSON: per token [logprob, [[id, logprob], ...top alternatives]]>]
    kind=finish  finish_reason=stop|length|abort  prompt_tokens=N  completion_tokens=N
    kind=error   type=<error type>  code=<code>  message=<text>
Exactly one `finish` or `error` entry ends every result stream. Flat string fields keep the
streams readable with plain `redis-cli XRANGE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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

    def to_fields(self) -> dict[str, str]:
        fields = {"kind": "tokens", "index": str(self.index), "ids": ",".join(map(str, self.ids))}
        if self.logprobs is not None:
            fields["logprobs"] = orjson.dumps(self.logprobs).decode()
        return fields


@dataclass(frozen=True)
class Finish:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prefix cache

    def to_fields(self) -> dict[str, str]:
        return {
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


def decode_result(fields: dict[bytes, bytes]) -> ResultEntry:
    f = {k.decode(): v.decode() for k, v in fields.items()}
    kind = f.get("kind")
    if kind == "tokens":
        ids = tuple(int(x) for x in f["ids"].split(",")) if f["ids"] else ()
        logprobs = None
        if "logprobs" in f:
            logprobs = tuple((float(lp), tuple((int(t), float(v)) for t, v in top))
                             for lp, top in orjson.loads(f["logprobs"]))
        return Tokens(index=int(f["index"]), ids=ids, logprobs=logprobs)
    if kind == "finish":
        reason = f["finish_reason"]
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason {reason!r}")
        return Finish(reason, int(f["prompt_tokens"]), int(f["completion_tokens"]),  # type: ignore[arg-type]
                      int(f.get("cached_tokens", "0")))
    if kind == "error":
        return Error(message=f["message"], type=f["type"], code=f["code"])
    raise ValueError(f"unknown result entry kind {kind!r}")


class RequestState:
    """Values of the `state` field of a request's hash (see `shared.keys`)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"
    ERROR = "error"
