"""`redserve bench URL`: its options, and the run from them to tables, JSON and a plot.

Only argparse and the option checks are imported at the top: `redserve --help` and every
other subcommand must not pay for httpx, numpy, tokenizers or matplotlib. Before the load, one
test request goes through exactly as the load's will, so a wrong model, a refused key or a
server that rejects `ignore_eos` is reported once, in one line, instead of as N failures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from ops.loadtest.config import (
    BenchConfig,
    BenchError,
    base_url,
    load_points,
    percentiles,
    positive_ints,
    rates,
    slo,
)
from ops.options import positive, positive_float

DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", type=base_url, help="the server's base URL: http://host:port or "
                   "http://host:port/v1")
    p.add_argument("--model", help="the model to ask for (default: the first that GET "
                   "/v1/models lists)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key "
                   "(default: OPENAI_API_KEY, else none)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (default) or /v1/completions")
    prompts = p.add_argument_group("prompts")
    prompts.add_argument("--input-len", type=positive, help="tokens of each random "
                         f"prompt, before any chat template (default {DEFAULT_INPUT_LEN})")
    prompts.add_argument("--output-len", type=positive, help="max_tokens of each request "
                         f"(default {DEFAULT_OUTPUT_LEN}); with ignore_eos every reply has "
                         "this many tokens")
    prompts.add_argument("--dataset", type=Path, help='JSONL file instead of random prompts: '
                         'one {"prompt": ...} or {"messages": [...]} a line, optionally with '
                         '"output_len"')
    prompts.add_argument("--tokenizer", help="tokenizer.json, a directory holding one, or a "
                         "Hub name (default: the served model's own, as a redserve model or on the "
                         "Hub; else the default model's, with a warning)")
    prompts.add_argument("--num-prompts", type=positive, help="requests per run "
                         "(default 100 random prompts, or every line of --dataset, reused "
                         "in order if fewer)")
    prompts.add_argument("--seed", type=int, default=0, help="seed of the random prompts and "
                         "of the arrival times (default 0)")
    prompts.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                         help="do not send ignore_eos=true (for servers that refuse it; "
                         "replies may then end early)")
    prompts.add_argument("--temperature", type=float, default=0.0, help="sampling "
                         "temperature (default 0, greedy)")
    load = p.add_argument_group("load (one run per value of a comma-separated sweep)")
    pattern = load.add_mutually_exclusive_group()
    pattern.add_argument("--concurrency", type=positive_ints, help="requests kept in flight, "
                         "e.g. 8 or 1,4,16")
    pattern.add_argument("--request-rate", type=rates, help="Poisson arrivals per second, "
                         "e.g. 2 or 1,2,4; inf sends all at once (the default)")
    load.add_argument("--max-concurrency", type=positive, help="with --request-rate: "
                      "most requests in flight; arrivals past it wait")
    load.add_argument("--timeout", type=positive_float, default=300.0, help="seconds one "
                      "request may take end to end before it counts as failed (default 300)")
    out = p.add_argument_group("results")
    out.add_argument("--percentiles", type=percentiles, default=(99.0,), help="latency "
                     "percentiles to report besides mean and median, e.g. 50,90,99 "
                     "(default 99)")
    out.add_argument("--goodput", type=slo, nargs="+", metavar="NAME:MS", help="SLOs in ms, "
                     "e.g. ttft:500 tpot:50 e2el:3000: goodput is the requests/s that met "
                     "all of them")
    out.add_argument("--result-json", type=Path, help="write every figure, the settings and "
                     "each request's record to this file")
    out.add_argument("--plot", type=Path, help="draw TTFT and E2E latency against output "
                     "tokens/s, a point per sweep value, into this image (e.g. sweep.png); needs "
                     "matplotlib: pip install 'redserve[bench]'")


def config_from(args: argparse.Namespace) -> BenchConfig:
    if args.max_concurrency is not None and args.concurrency is not None:
        raise BenchError("--max-concurrency goes with --request-rate; --concurrency already "
                         "fixes the requests in flight")
    if args.dataset is not None and args.input_len is not None:
        raise BenchError("--input-len sets random prompts; --dataset brings its own")
    slos = dict(args.goodput or ())
    if args.goodput and len(slos) != len(args.goodput):
        raise BenchError("--goodput names an SLO twice")
    if args.temperature < 0:
        raise BenchError("--temperature must be at least 0")
    return BenchConfig(
        base_url=args.url, model=args.model, api_key=args.api_key or None,
        endpoint=args.endpoint, input_len=args.input_len or DEFAULT_INPUT_LEN,
        output_len=args.output_len or DEFAULT_OUTPUT_LEN, dataset=args.dataset,
        tokenizer=args.tokenizer, num_prompts=args.num_prompts, seed=args.seed,
        ignore_eos=args.ignore_eos, temperature=args.temperature, timeout=args.timeout,
        percentiles=args.percentiles, goodput=slos,
        points=load_points(args.concurrency, args.request_rate, args.max_concurrency),
        result_json=args.result_json, plot=args.plot,
    )


def run(args: argparse.Namespace) -> int:
    """0 when every run completed requests; 1 when one completed none or the benchmark could
    not start (the reason printed in red); 2 for contradictory options, or --plot without
    matplotlib; 130 on Ctrl-C."""
    from rich.text import Text

    from ops.console import make_console

    errors = make_console(stderr=True)

    def fail(reason: object, status: int) -> int:
        # The reason may quote the server (an error body, a model id): printed as it is.
        errors.print(Text(f"redserve bench: {reason}", style="red"))
        return status

    try:
        config = config_from(args)
        if config.plot is not None:  # found out before the load, not after it
            from ops.loadtest.plot import require_matplotlib

            require_matplotlib()
    except BenchError as e:
        return fail(e, 2)
    from ops.loadtest.session import bench

    try:
        return asyncio.run(bench(config, make_console()))
    except BenchError as e:
        return fail(e, 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
