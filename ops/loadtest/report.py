"""What a benchmark prints and writes: rich tables per run and per sweep, and the result JSON.

The tables name each figure as `vllm bench serve` does, so its users read them without a key;
the JSON holds every figure, the settings that produced them and every request's record, so a
result can be re-examined (or its goodput recomputed under other SLOs) without running again.
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ops.loadtest.config import BenchConfig, BenchError, LoadPoint
from ops.loadtest.stats import Distribution, RequestRecord, Summary

_LATENCIES = (("ttft", "TTFT", "time to first token"),
              ("tpot", "TPOT", "time per output token, after the first"),
              ("itl", "ITL", "inter-token latency"),
              ("e2el", "E2EL", "end-to-end latency"))


@dataclass(frozen=True)
class RunResult:
    point: LoadPoint
    summary: Summary
    records: list[RequestRecord]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def print_run(console: Console, result: RunResult, config: BenchConfig) -> None:
    s = result.summary
    figures = Table(title=f"Serving benchmark: {result.point.label}", title_justify="left",
                    show_header=False)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for name, value in (
        ("Successful requests", f"{s.completed}"),
        ("Failed requests", f"{s.failed}"),
        ("Benchmark duration (s)", f"{s.duration_s:,.2f}"),
        ("Total input tokens", f"{s.total_input_tokens:,}"),
        ("Total generated tokens", f"{s.total_output_tokens:,}"),
        ("Request throughput (req/s)", f"{s.request_throughput:,.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:,.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:,.2f}"),
        ("Peak concurrent requests", f"{s.peak_concurrency}"),
        ("Streams resumed on another replica", f"{s.resumed}"),
    ):
        figures.add_row(name, value)
    if s.goodput is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in config.goodput.items())
        figures.add_row(f"Goodput (req/s) under {slos} ms", f"{s.goodput:,.2f}")
    console.print(figures)
    latency = Table(title="Latency (ms)", title_justify="left")
    latency.add_column("metric")
    for column in ("mean", "median", *(f"P{p:g}" for p in config.percentiles)):
        latency.add_column(column, justify="right")
    for attr, short, what in _LATENCIES:
        dist: Distribution | None = getattr(s, attr)
        if dist is None:
            latency.add_row(f"{short} ({what})", *["-"] * (2 + len(config.percentiles)))
        else:
            latency.add_row(f"{short} ({what})", _ms(dist.mean), _ms(dist.median),
                            *(_ms(dist.percentiles[p]) for p in config.percentiles))
    console.print(latency)
    print_failures(console, result.records)


def print_failures(console: Console, records: list[RequestRecord]) -> None:
    reasons = Counter(r.error for r in records if not r.ok)
    for reason, count in reasons.most_common(3):  # a reason may quote the server: plain text
        console.print(Text.assemble((f"{count} failed:", "red"), f" {reason}"))
    if len(reasons) > 3:
        console.print(f"[red]... and {len(reasons) - 3} other reasons (see --result-json)[/red]")


def print_sweep(console: Console, results: list[RunResult], config: BenchConfig) -> None:
    high = f"P{max(config.percentiles):g}"
    table = Table(title="Sweep (latencies in ms, medians unless named)", title_justify="left")
    columns = ["load", "ok", "failed", "req/s", "out tok/s", "total tok/s", "TTFT",
               f"TTFT {high}", "TPOT", "ITL", "E2EL", f"E2EL {high}"]
    if config.goodput:
        columns.append("goodput req/s")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for r in results:
        s = r.summary
        row = [r.point.label, str(s.completed), str(s.failed), f"{s.request_throughput:,.2f}",
               f"{s.output_throughput:,.1f}", f"{s.total_token_throughput:,.1f}",
               _median(s.ttft), _high(s.ttft), _median(s.tpot), _median(s.itl),
               _median(s.e2el), _high(s.e2el)]
        if s.goodput is not None:
            row.append(f"{s.goodput:,.2f}")
        table.add_row(*row)
    console.print(table)


def _median(dist: Distribution | None) -> str:
    return "-" if dist is None else _ms(dist.median)


def _high(dist: Distribution | None) -> str:
    return "-" if dist is None else _ms(dist.percentiles[max(dist.percentiles)])


def result_document(config: BenchConfig, model: str, tokenizer: str | None,
                    results: list[RunResult]) -> dict[str, Any]:
    """`tokenizer`: the one prompts were counted in (--tokenizer, the model's name, or the
    default model's when the model's own was not found)."""
    return {
        "tool": "redserve bench",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": config.base_url,
        "model": model,
        "endpoint": config.endpoint,
        "settings": {
            "input_len": None if config.dataset else config.input_len,
            "output_len": config.output_len,
            "dataset": None if config.dataset is None else str(config.dataset),
            "tokenizer": tokenizer,
            "num_prompts": config.num_prompts,
            "seed": config.seed,
            "ignore_eos": config.ignore_eos,
            "temperature": config.temperature,
            "timeout_s": config.timeout,
            "percentiles": list(config.percentiles),
            "goodput_slos_ms": config.goodput,
        },
        "runs": [{"label": r.point.label, "load": r.point.as_dict(), **r.summary.as_dict(),
                  "requests": [rec.as_dict() for rec in r.records]} for r in results],
    }


def write_result(path: Path, document: dict[str, Any]) -> None:
    try:
        path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    except OSError as e:
        raise BenchError(f"cannot write --result-json {path}: {e}") from e
