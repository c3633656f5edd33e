"""The request a replica puts on its model's stream: what a worker needs to run it, and
nothing it must look up elsewhere (prompt ids, sampling, deadlines, tenant, grammar)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.messages.queue import QueueMember

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
    # Draft tokens may be verified for it when its worker speculates (worker/engine/speculation/);
    # False: one token a step, as the body's `speculation: false` asks.
    speculate: bool = True


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
    # The output's grammar (`shared.request_grammar`), when constrained: JSON schema, regex, choice,
    # Lark grammar or tool calls, compiled by the replica into llguidance's grammar format.
    grammar: str | None = None
    trace_id: str = ""
    # W3C `traceparent` of the replica's span for this request, when it is traced
    # (shared/tracing.py): the worker's spans are its children. Absent from the entry's JSON
    # when None, so tracing off adds nothing to the stream.
    traceparent: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                    max_length=55)
    # Scheduling (see api/queue/admission.py and worker/broker/intake.py): vLLM's `priority` (lower
    # runs first), the tenant's fair-share weight (shared/tenants.py), and the worker placement
    # chose because it holds the prompt's prefix ("" = any worker).
    priority: int = 0
    weight: float = Field(default=1.0, gt=0)
    worker: str = ""
    # The LoRA adapter the request named in "model" (shared/lora.py), applied over `model`, its
    # base; absent from the entry's JSON when none, so a base request's entry is unchanged.
    lora: str = Field(default="", exclude_if=lambda v: not v, max_length=128)
    # Where that adapter lives (its PEFT directory, as the replica knows it): a worker that does
    # not hold it loads it from there (worker/engine/lora/resident.py). Absent when empty.
    lora_path: str = Field(default="", exclude_if=lambda v: not v, max_length=4096)

    def to_fields(self) -> dict[str, str]:
        return {"id": self.id, "body": self.model_dump_json()}

    @property
    def queue_member(self) -> str:
        """Its member in the model's queued set (see shared/messages/queue.py)."""
        return QueueMember(self.id, self.tenant, len(self.prompt_ids), self.priority,
                           self.weight, self.worker).encode()

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> GenerateRequest:
        return cls.model_validate_json(fields[b"body"])

