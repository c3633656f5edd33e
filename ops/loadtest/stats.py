"""The figures of one run, from its per-request records, defined as `vllm bench serve` does.

- TTFT: from sending the request to the first streamed chunk that carries tokens.
- TPOT: per request, (E2E latency - TTFT) / (output tokens - 1): the decode pace after the
  first token; a request of one token has none.
- ITL: every gap between consecutive token-carrying chunks, all requests pooled; a chunk that
  carries several tokens is one gap, as a client sees it.
- E2E latency: from sending the request to its last byte.
- Goodput: requests per second that completed within every SLO given (a request without a
  TPOT meets any TPOT objective).
Throughputs divide by the run's wall time; failed requests count in no figure but `failed`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RequestRecord:
    index: int
    start_s: float  # when it was sent, from the start of the run
    ok: bool
    error: str | None
    input_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2el_s: float  # to its last byte, or to its failure
    itl_s: tuple[float, ...]
    resumes: int = 0  # times its stream was resumed on another replica (one stopped)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class Distribution:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of_seconds(cls, values: list[float], percentiles: tuple[float, ...]
                   ) -> Distribution | None:
        if not values:
            return None
        ms = np.asarray(values) * 1000.0
        points = np.percentile(ms, percentiles) if percentiles else np.array([])
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(v) for p, v in zip(percentiles, points, strict=True)})

    def as_dict(self) -> dict[str, float]:
        return {"mean_ms": self.mean, "median_ms": self.median, "std_ms": self.std,
                **{f"p{p:g}_ms": v for p, v in self.percentiles.items()}}


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_concurrency: int
    resumed: int  # requests whose stream was resumed on another replica
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    good_requests: int | None  # None: no --goodput
    goodput: float | None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in asdict(self).items()
                               if k not in ("ttft", "tpot", "itl", "e2el")}
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist: Distribution | None = getattr(self, name)
            out[name] = None if dist is None else dist.as_dict()
        return out


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a request completed within every SLO (milliseconds by metric name)."""
    if not record.ok or record.ttft_s is None:
        return False
    measured = {"ttft": record.ttft_s, "e2el": record.e2el_s, "tpot": record.tpot_s}
    for name, limit in slos.items():
        value = measured[name]
        if value is not None and value * 1000.0 > limit:
            return False
    return True


def peak_concurrency(records: list[RequestRecord]) -> int:
    """The most requests in flight at once (one ending as another starts: not both)."""
    events = sorted([(r.start_s, 1) for r in records]
                    + [(r.start_s + r.e2el_s, -1) for r in records])
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def summarize(records: list[RequestRecord], duration_s: float, percentiles: tuple[float, ...],
              goodput: dict[str, float]) -> Summary:
    done = [r for r in records if r.ok]
    inputs = sum(r.input_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    good = sum(meets(r, goodput) for r in done) if goodput else None
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(done) * per_s, output_throughput=outputs * per_s,
        total_token_throughput=(inputs + outputs) * per_s,
        peak_concurrency=peak_concurrency(records),
        resumed=sum(r.resumes > 0 for r in done),
        ttft=Distribution.of_seconds([r.ttft_s for r in done if r.ttft_s is not None],
                                     percentiles),
        tpot=Distribution.of_seconds([t for r in done if (t := r.tpot_s) is not None],
                                     percentiles),
        itl=Distribution.of_seconds([g for r in done for g in r.itl_s], percentiles),
        e2el=Distribution.of_seconds([r.e2el_s for r in done], percentiles),
        good_requests=good, goodput=None if good is None else good * per_s,
    )
