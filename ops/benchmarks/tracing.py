"""What tracing costs: `redserve up` serving the same load with tracing off and on, and
optionally the same load on the code from before tracing was added.

    python -m ops.benchmarks.tracing [--streams 32] [--max-tokens 64] [--rounds 2]
                                     [--dtype auto] [--before PATH]

`--before PATH`: a checkout from before tracing (`git worktree add PATH 077a799`), run on this
environment, as a third arm: tracing off should cost nothing against it, within the noise
(the rounds' own spread, printed beside the ratio). That checkout lacks every later change
too, so off may well beat it; only a loss beyond the noise is a cost.

Tracing is opt-in (shared/tracing.py, docs/observability.md#traces); the target is that off it
costs nothing and on, every request sampled (`OTEL_TRACES_SAMPLER=always_on`), a load keeps >=
0.95x of its output tokens/s. The load is serve.py's: `--streams` concurrent chat streams of up
to `--max-tokens` tokens through HTTP, greedy, the default model. The spans go over OTLP/HTTP
to a receiver in this process (ops/testkit/otlp_receiver.py), which answers at once and keeps
them, so an export costs what it costs against a collector that keeps up; the run counts what
it kept, to check that every request sent spans. Off and on alternate, `--rounds` times each,
each round on a fresh `redserve up` after a warm-up, so a drift of the machine falls on both;
each round's figure is printed, and the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from rich.table import Table

from ops.benchmarks.harness.client import percentile
from ops.benchmarks.machine import describe
from ops.benchmarks.peers import redserve
from ops.benchmarks.serve import Load, Run, run_load, stories
from ops.console import make_console
from ops.testkit.otlp_receiver import OTLPReceiver
from shared.settings import DEFAULT_MODEL


def _round(dtype: str, env: dict[str, str], streams: int, max_tokens: int,
           tree: str | None) -> Load:
    server = redserve(dtype, env, tree)
    try:
        server.wait()
        asyncio.run(run_load(server, Run(stories(4), 8)))  # warm-up
        return asyncio.run(run_load(server, Run(stories(streams), max_tokens)))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    ap.add_argument("--dtype", default="auto", help="redserve's --dtype (default auto)")
    ap.add_argument("--before", metavar="PATH",
                    help="a checkout from before tracing: a third arm, tracing off's baseline")
    args = ap.parse_args()
    console = make_console()
    console.print(describe())
    sink = OTLPReceiver().start()
    settings = {
        "off": {},
        "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_TRACES_SAMPLER": "always_on"},
    }
    trees: dict[str, str | None] = {"off": None, "on": None}
    if args.before:
        settings["before"], trees["before"] = {}, args.before
    loads: dict[str, list[Load]] = {name: [] for name in settings}
    spans = 0
    for i in range(args.rounds):
        for name, env in settings.items():
            with console.status(f"round {i + 1}: tracing {name}"):
                before = len(sink.spans)
                loads[name].append(_round(args.dtype, env, args.streams, args.max_tokens,
                                          trees[name]))
                if name == "on":
                    spans += len(sink.spans) - before
                elif len(sink.spans) != before:
                    raise RuntimeError("tracing off, and yet spans were sent")
    sink.stop()
    table = Table(title=f"{args.streams} streams x {args.max_tokens} tokens, {DEFAULT_MODEL}, "
                        "greedy, through HTTP: tracing off and on (always_on)")
    for col in ("tracing", "round", "tokens", "tokens/s", "TTFT p50 ms", "ITL p50 ms"):
        table.add_column(col)
    for name, runs in loads.items():
        for i, load in enumerate(runs, start=1):
            table.add_row(name, str(i), str(load.tokens), f"{load.rate:.1f}",
                          f"{percentile(load.ttft, 0.5) * 1e3:.0f}",
                          f"{percentile(load.itl or [0.0], 0.5) * 1e3:.1f}")
    console.print(table)
    off = statistics.median(load.rate for load in loads["off"])
    on = statistics.median(load.rate for load in loads["on"])
    # Every request of the measured loads and warm-ups (and each start's probe) sent spans.
    requests = args.rounds * (args.streams + 4)
    verdict = "met" if on >= 0.95 * off else "MISSED"
    console.print(f"tokens/s median: off {off:.1f}, on {on:.1f}: {on / off:.3f}x "
                  f"(target >= 0.95x: {verdict}); {spans} spans received from at least "
                  f"{requests} traced requests")
    if args.before:
        baseline = statistics.median(load.rate for load in loads["before"])
        noise = max(_spread(loads[name]) for name in ("off", "before"))
        # A cost is what the target rules out: off may beat the old code (which lacks every
        # later change too, not tracing alone), not lose to it by more than the noise.
        verdict = "no cost" if off >= baseline * (1 - noise) else "SLOWER beyond the noise"
        console.print(f"tracing off against before tracing: {off:.1f} vs {baseline:.1f} "
                      f"tokens/s, {off / baseline:.3f}x; the rounds' range is {noise:.1%}: "
                      f"{verdict}")


def _spread(loads: list[Load]) -> float:
    """How far one arm's rounds lie apart: (max - min) / median of their tokens/s."""
    rates = [load.rate for load in loads]
    return (max(rates) - min(rates)) / statistics.median(rates)


if __name__ == "__main__":
    main()
