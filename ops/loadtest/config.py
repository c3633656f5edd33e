"""What a benchmark was asked to do, checked once and frozen.

Every value that reaches the load comes from here, so a bad one (a negative rate, an unknown
SLO, a URL that is no URL) is refused by argparse with its name before anything is sent, and
the result file can record the settings exactly as they were used.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from ops.options import positive_float

SLO_METRICS = ("ttft", "tpot", "e2el")
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class LoadPoint:
    """One measurement of a sweep: a fixed number in flight, or Poisson arrivals at a rate
    (inf: all at once) with an optional cap on those in flight."""

    concurrency: int | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        cap = f", max {self.max_concurrency}" if self.max_concurrency is not None else ""
        return f"rate {rate}{cap}"

    @property
    def short(self) -> str:
        """The label of this point on a plot."""
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"

    def as_dict(self) -> dict[str, float | int | str | None]:
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        return {"request_rate": rate, "max_concurrency": self.max_concurrency}


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # ends with /v1
    model: str | None  # None: the first of GET /v1/models
    api_key: str | None
    endpoint: str  # "chat" or "completions"
    input_len: int
    output_len: int
    dataset: Path | None
    tokenizer: str | None  # a tokenizer.json, a directory holding one, or a Hub name
    num_prompts: int | None  # None: 100 random prompts, or every line of the dataset
    seed: int
    ignore_eos: bool
    temperature: float
    timeout: float  # seconds one request may take, end to end
    percentiles: tuple[float, ...]
    goodput: dict[str, float]  # SLO name -> milliseconds
    points: tuple[LoadPoint, ...]
    result_json: Path | None
    plot: Path | None


def base_url(text: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/` as the API base ending in `/v1`."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s):// URL")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r}: give the server's base URL, no query")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _sweep(text: str, parse: Callable[[str], N], kind: str, valid: Callable[[N], bool],
           rule: str) -> tuple[N, ...]:
    """Comma-separated values, each parsed by `parse` and checked by `valid`; a bad one is
    refused naming `kind` (what the values are) or `rule` (what each must be)."""
    try:
        values = tuple(parse(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {kind}, comma-separated") from None
    if not all(valid(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each must be {rule}")
    return values


def positive_ints(text: str) -> tuple[int, ...]:
    """`4` or a sweep `1,4,16`: each at least 1."""
    return _sweep(text, int, "integers", lambda v: v >= 1, "at least 1")


def rates(text: str) -> tuple[float, ...]:
    """`2` or a sweep `1,2,inf` in requests per second: each above 0."""
    return _sweep(text, float, "numbers or inf", lambda v: v > 0,
                  "above 0 (inf: all at once)")


def percentiles(text: str) -> tuple[float, ...]:
    """`99` or `50,90,99`: each above 0 and below 100, sorted, each once."""
    return tuple(sorted(set(_sweep(text, float, "numbers", lambda v: 0 < v < 100,
                                   "above 0 and below 100"))))


def slo(text: str) -> tuple[str, float]:
    """`ttft:500`: a service-level objective in milliseconds."""
    name, sep, value = text.partition(":")
    if not sep or name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: an SLO is NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
    try:
        return name, positive_float(value)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: the milliseconds, {e}") from None


def load_points(concurrency: tuple[int, ...] | None, request_rate: tuple[float, ...] | None,
                max_concurrency: int | None) -> tuple[LoadPoint, ...]:
    if concurrency is not None:
        return tuple(LoadPoint(concurrency=c) for c in concurrency)
    return tuple(LoadPoint(request_rate=r, max_concurrency=max_concurrency)
                 for r in request_rate or (math.inf,))


class BenchError(Exception):
    """A problem the user can fix (a bad dataset line, an unreachable server, every request
    refused), reported as one line and a non-zero exit, never as a traceback."""
