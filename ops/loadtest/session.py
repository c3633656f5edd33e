"""One benchmark from settings to results: the server found, a test request, then each run.

The tokenizer comes first when --tokenizer names it (a bad dataset line is then reported
before the server is touched); otherwise it is the served model's, so it waits for the model's
name. A sweep runs its values in the order given, each with its own prompts; it stops at the
first run that completed no request, since every later one would fail the same way, and still
writes what it measured. Model ids and error messages come from the server: they are printed
as text, never read as rich markup.
"""

from __future__ import annotations

import httpx
from rich.console import Console
from rich.text import Text
from tokenizers import Tokenizer

from ops.console import make_progress
from ops.loadtest.client import Target, discover_model, headers, send
from ops.loadtest.config import BenchConfig, BenchError
from ops.loadtest.dataset import (
    DEFAULT_RANDOM_PROMPTS,
    Prompt,
    load_tokenizer,
    model_tokenizer,
    random_prompts,
    read_dataset,
)
from ops.loadtest.load import run_point
from ops.loadtest.report import (
    RunResult,
    print_run,
    print_sweep,
    result_document,
    write_result,
)
from ops.loadtest.stats import summarize


def prompts_for(config: BenchConfig, tokenizer: Tokenizer, run: str,
                count: int | None = None) -> list[Prompt]:
    """The prompts of one run (`run` seeds a random draw), or the first `count` of them."""
    if config.dataset is not None:
        prompts = read_dataset(config.dataset, tokenizer, config.output_len,
                               config.num_prompts, config.endpoint)
        return prompts[:count]
    return random_prompts(tokenizer, count or config.num_prompts or DEFAULT_RANDOM_PROMPTS,
                          config.input_len, config.output_len, f"{config.seed}/{run}")


async def bench(config: BenchConfig, console: Console) -> int:
    tokenizer = None
    if config.tokenizer is not None:
        with console.status("loading the tokenizer"):
            tokenizer = _checked(config, load_tokenizer(config.tokenizer))
    # Every request holds its own connection; none waits in the pool, or the wait would be
    # counted as the server's time to first token.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers(config.api_key), limits=limits,
                                 timeout=httpx.Timeout(config.timeout)) as client:
        model = await discover_model(client, config.base_url, config.model)
        counted_in = config.tokenizer
        if tokenizer is None:
            with console.status("loading the model's tokenizer"):
                found, counted_in = model_tokenizer(model)
            if counted_in != model:
                console.print(fallback_warning(model, counted_in))
            tokenizer = _checked(config, found)
        target = Target(config.base_url, model, config.endpoint, config.ignore_eos,
                        config.temperature, config.timeout)
        await _test_request(client, target, config, tokenizer)
        console.print(header(model, target.url, config))
        results = await _runs(client, target, config, tokenizer, console)
    if len(results) > 1:
        print_sweep(console, results, config)
    if config.result_json is not None:
        write_result(config.result_json, result_document(config, model, counted_in, results))
        console.print(Text(f"results written to {config.result_json}"))
    if config.plot is not None:
        from ops.loadtest.plot import plot_sweep

        plot_sweep(config.plot, results, f"{model} at {config.base_url}")
        console.print(Text(f"plot written to {config.plot}"))
    return 0 if all(r.summary.completed for r in results) else 1


def _checked(config: BenchConfig, tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer`, once every line of the dataset (if any) has been read with it: a bad line
    is reported before any request is sent."""
    if config.dataset is not None:
        prompts_for(config, tokenizer, "check")
    return tokenizer


def fallback_warning(model: str, counted_in: str) -> Text:
    return Text(f"warning: no tokenizer found for {model} (neither a redserve model nor on "
                f"the Hugging Face Hub, or the Hub is unreachable): input lengths are counted "
                f"in {counted_in}'s tokens; give --tokenizer for the model's own",
                style="yellow")


def header(model: str, url: str, config: BenchConfig) -> Text:
    """The line naming what is measured (the model id as the server spelled it)."""
    what = (f"dataset {config.dataset}" if config.dataset is not None
            else f"random prompts of {config.input_len} tokens")
    return Text.assemble("benchmarking ", (model, "bold"),
                         f" at {url}: {what}, max_tokens {config.output_len}"
                         f"{', ignore_eos' if config.ignore_eos else ''}")


async def _test_request(client: httpx.AsyncClient, target: Target, config: BenchConfig,
                        tokenizer: Tokenizer) -> None:
    probe = prompts_for(config, tokenizer, "test", count=1)[0]
    record = await send(client, target, probe, 0, 0.0, tokenizer)
    if not record.ok:
        hint = (" (the server may not take ignore_eos: try --no-ignore-eos)"
                if target.ignore_eos and "ignore_eos" in (record.error or "") else "")
        raise BenchError(f"the test request to {target.url} failed: {record.error}{hint}")


async def _runs(client: httpx.AsyncClient, target: Target, config: BenchConfig,
                tokenizer: Tokenizer, console: Console) -> list[RunResult]:
    results = []
    with make_progress(console) as progress:
        for i, point in enumerate(config.points):
            prompts = prompts_for(config, tokenizer, str(i))
            records, duration = await run_point(client, target, prompts, point,
                                                f"{config.seed}/{i}/arrivals", tokenizer,
                                                progress)
            summary = summarize(records, duration, config.percentiles, config.goodput)
            results.append(RunResult(point, summary, records))
            print_run(console, results[-1], config)
            if not summary.completed:
                if i + 1 < len(config.points):
                    console.print("[red]no request completed: the sweep stops here[/red]")
                break
    return results

