"""Latency against throughput over a sweep, one labelled point per sweep value.

The question a sweep answers is how much latency each step of throughput costs, and where
the curve turns up; two panels (time to first token, end-to-end latency) because the two
differ by orders of magnitude. The figure is drawn on matplotlib's Agg canvas directly: no
pyplot, no display, no global state. matplotlib is an optional dependency (the `bench` extra),
imported only here and only when a plot is asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ops.loadtest.config import BenchError
from ops.loadtest.report import RunResult
from ops.loadtest.stats import Distribution


def require_matplotlib() -> None:
    """BenchError, in one line, when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise BenchError("--plot needs matplotlib, which is not installed: "
                         "pip install 'redserve[bench]'") from e


def plot_sweep(path: Path, results: list[RunResult], title: str) -> None:
    # Its first import on a machine builds a font cache and says so at INFO.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = [r for r in results if r.summary.completed]
    if not shown:
        raise BenchError(f"--plot {path}: no run completed a request, nothing to plot")
    figure = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(figure)
    xs = [r.summary.output_throughput for r in shown]
    for axes, attr, name in zip(figure.subplots(1, 2), ("ttft", "e2el"),
                                ("Time to first token", "End-to-end latency"), strict=True):
        dists: list[Distribution] = [getattr(r.summary, attr) for r in shown]
        high = max(dists[0].percentiles)
        axes.plot(xs, [d.median for d in dists], "o-", label="median")
        axes.plot(xs, [d.percentiles[high] for d in dists], "s--", label=f"P{high:g}")
        for x, dist, result in zip(xs, dists, shown, strict=True):
            axes.annotate(result.point.short, (x, dist.median), textcoords="offset points",
                          xytext=(5, 5), fontsize=8)
        axes.set_title(name)
        axes.set_xlabel("output tokens/s")
        axes.set_ylabel("ms")
        axes.margins(x=0.12, y=0.1)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    try:
        figure.savefig(path, dpi=110)
    except (OSError, ValueError) as e:  # ValueError: an extension no backend writes
        raise BenchError(f"cannot write --plot {path}: {e}") from e
