"""One request's times on a worker (`Clock`): kept by the metrics (`worker.broker.metrics`) and
read by the request's span (`worker.broker.spans`), so both import it from here rather than
from each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Clock:
    """One request's times on this worker, from its admission until its terminal entry."""

    created: float
    queue_s: float | None  # None: resumed from another worker's tokens
    admitted: float = 0.0  # when the engine scheduled its first step
    cached: int = 0  # prompt tokens from the prefix cache
    ttft_s: float | None = None
    first: float | None = None  # when this worker's first tokens for it were written
    last: float | None = None  # when its last tokens were written
    ending: float | None = None  # when its terminal entry was staged
    tokens: int = 0  # tokens this worker published for it
