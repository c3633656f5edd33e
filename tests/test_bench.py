"""`redserve bench`: its statistics on hand-made records, its prompts on the real tokenizer,
its SSE parsing on odd events (through a real socket), and the command itself as a subprocess
against a real stack (uvicorn, Redis, a worker)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from ops.embedded_redis import free_port
from ops.loadtest.client import Event, StreamError, Target, parse_event, send
from ops.loadtest.config import BenchError, base_url, percentiles, positive_ints, rates, slo
from ops.loadtest.dataset import (
    Prompt,
    _word_ids,
    count_tokens,
    load_tokenizer,
    model_tokenizer,
    random_prompts,
    read_dataset,
)
from ops.loadtest.report import print_failures
from ops.loadtest.session import fallback_warning
from ops.loadtest.stats import RequestRecord, meets, peak_concurrency, summarize
from shared.settings import DEFAULT_MODEL
from tests.stack import Stack

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(index: int, start: float, ttft: float | None, e2el: float, output: int,
            inputs: int, itl: tuple[float, ...] = (), error: str | None = None) -> RequestRecord:
    return RequestRecord(index, start, error is None, error, inputs, output, ttft, e2el, itl)


# Four requests over a 4 s run: A and B stream several tokens, C only one (no TPOT), D fails.
A = _record(0, 0.0, 0.2, 1.1, 10, 4, (0.1,) * 9)
B = _record(1, 0.5, 0.4, 2.4, 5, 6, (0.5,) * 4)
C = _record(2, 1.0, 0.3, 0.3, 1, 2)
D = _record(3, 1.5, None, 0.05, 0, 3, error="HTTP 400: bad")


def test_summary_figures_follow_their_definitions() -> None:
    s = summarize([A, B, C, D], 4.0, (50.0, 90.0), {})
    assert (s.completed, s.failed) == (3, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (12, 16)  # D counts in neither
    assert s.request_throughput == pytest.approx(0.75)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.total_token_throughput == pytest.approx(7.0)
    assert s.ttft is not None and s.tpot is not None and s.itl is not None
    assert s.e2el is not None
    assert (s.ttft.mean, s.ttft.median) == (pytest.approx(300), pytest.approx(300))
    # numpy's linear interpolation over 200, 300, 400 ms
    assert s.ttft.percentiles == {50.0: pytest.approx(300), 90.0: pytest.approx(380)}
    # TPOT: (1.1 - 0.2) / 9 and (2.4 - 0.4) / 4; C has one token, so none
    assert B.tpot_s == pytest.approx(0.5) and C.tpot_s is None and D.tpot_s is None
    assert (s.tpot.mean, s.tpot.median) == (pytest.approx(300), pytest.approx(300))
    # ITL pools every gap: nine of 100 ms, four of 500 ms
    assert s.itl.median == pytest.approx(100)
    assert s.itl.mean == pytest.approx((9 * 100 + 4 * 500) / 13)
    assert (s.e2el.median, s.e2el.mean) == (pytest.approx(1100), pytest.approx(3800 / 3))
    assert s.peak_concurrency == 3  # A, B and C at t = 1.0
    assert s.goodput is None and s.good_requests is None


def test_goodput_counts_completed_requests_within_every_slo() -> None:
    # A meets both; B misses TTFT; C has no TPOT, which meets any TPOT objective; D failed.
    assert [meets(r, {"ttft": 350, "tpot": 200}) for r in (A, B, C, D)] == [
        True, False, True, False]
    assert [meets(r, {"e2el": 1000}) for r in (A, B, C, D)] == [False, False, True, False]
    assert meets(B, {"tpot": 500}) and not meets(B, {"tpot": 499})
    s = summarize([A, B, C, D], 4.0, (99.0,), {"ttft": 350, "tpot": 200})
    assert s.good_requests == 2 and s.goodput == pytest.approx(0.5)
    assert summarize([A, B, C, D], 4.0, (99.0,), {"e2el": 1}).goodput == 0.0


def test_a_run_with_no_completed_request_has_no_latencies() -> None:
    s = summarize([D], 1.0, (99.0,), {"ttft": 1})
    assert (s.completed, s.failed, s.good_requests) == (0, 1, 0)
    assert s.ttft is None and s.itl is None and s.output_throughput == 0.0
    assert s.as_dict()["ttft"] is None


def test_peak_concurrency_does_not_count_back_to_back_requests_twice() -> None:
    back_to_back = [_record(0, 0.0, 0.1, 1.0, 2, 1), _record(1, 1.0, 0.1, 1.0, 2, 1)]
    assert peak_concurrency(back_to_back) == 1
    assert peak_concurrency([]) == 0


def test_option_values_are_checked() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert base_url(url) == "http://h:8000/v1"
    assert base_url("https://h/proxy") == "https://h/proxy/v1"
    assert rates("1,2.5,inf") == (1.0, 2.5, math.inf)
    assert percentiles("99,50,90,99") == (50.0, 90.0, 99.0)
    assert positive_ints("1,4,16") == (1, 4, 16)
    assert slo("tpot:50") == ("tpot", 50.0)
    for check, bad, why in (
            (base_url, "localhost:8000", "not an http"), (rates, "0", "above 0"),
            (rates, "nan", "above 0"), (rates, "fast", "numbers or inf, comma-separated"),
            (percentiles, "100", "below 100"), (positive_ints, "1,0", "at least 1"),
            (positive_ints, "1.5", "integers, comma-separated"), (slo, "ttft", "NAME:MILLISECONDS"),
            (slo, "itl:5", "NAME:MILLISECONDS"), (slo, "e2el:-1", "above 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            check(bad)


@pytest.mark.parametrize(("payload", "problem"), [
    (b"[1]", "unexpected event"),
    (b'{"choices": ["hi"]}', "unexpected choice"),  # an item that is no object
    (b'{"choices": [{"delta": "hi"}]}', "unexpected choice"),
    (b'{"choices": {"0": {"text": "hi"}}}', "unexpected event"),
    (b'{"choices": [{"text": 5}]}', "unexpected text"),
    (b'{"choices": [], "usage": [3, 4]}', "unexpected event"),  # a usage that is no object
    (b'{"error": {"message": "model [/b] is gone"}}', "error event: model [/b] is gone"),
])
def test_odd_events_are_refused_with_the_reason(payload: bytes, problem: str) -> None:
    with pytest.raises(StreamError, match=re.escape(problem)):
        parse_event(payload)


def test_events_of_chat_and_completions_servers() -> None:
    assert parse_event(b'{"choices": [{"delta": {"content": "Hi"}}], "usage": null}') == \
        Event("Hi", None)
    assert parse_event(b'{"choices": [{"delta": {"reasoning_content": "hm"}}]}').text == "hm"
    assert parse_event(b'{"choices": [{"text": "a"}, {"text": "b"}]}').text == "ab"
    assert parse_event(b'{"choices": [], "usage": {"completion_tokens": 3}}') == \
        Event("", {"completion_tokens": 3})


@asynccontextmanager
async def _canned_sse(body: bytes) -> AsyncIterator[str]:
    """A real HTTP server on a local port that answers every request with `body` as an SSE
    stream; yields its base URL."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.mark.parametrize(("events", "reason"), [
    ([b'{"choices": [{"delta": {"content": "Hi"}}]}', b'{"choices": [7]}'],
     "unexpected choice"),
    # Well-formed, but a count that is no number: caught as any other failure would be.
    ([b'{"choices": [{"delta": {"content": "Hi"}}]}',
      b'{"choices": [], "usage": {"completion_tokens": "many"}}'], "ValueError"),
    ([b"{not json"], "an event is not JSON"),
])
async def test_an_odd_reply_fails_its_request_not_the_run(tiny_model: Path, events: list[bytes],
                                                          reason: str) -> None:
    body = b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    async with _canned_sse(body) as url:
        target = Target(url, "m", "chat", True, 0.0, 30.0)
        async with httpx.AsyncClient() as client:
            record = await send(client, target, Prompt("hi", None, 1, 4), 0, 0.0,
                                load_tokenizer(str(tiny_model)))
    assert not record.ok and record.error is not None and reason in record.error


def test_text_from_the_server_is_printed_as_it_is() -> None:
    out = io.StringIO()
    console = Console(file=out, width=300)
    print_failures(console, [_record(0, 0.0, None, 0.1, 0, 1, error="HTTP 404: model [/b]")])
    console.print(fallback_warning("org/m[/b]", DEFAULT_MODEL))
    assert "1 failed: HTTP 404: model [/b]" in out.getvalue()
    assert "no tokenizer found for org/m[/b]" in out.getvalue()
    assert f"counted in {DEFAULT_MODEL}'s tokens" in out.getvalue()


def test_the_tokenizer_is_the_models_own_when_it_can_be_found(tiny_model: Path) -> None:
    tokenizer, counted_in = model_tokenizer(str(tiny_model))  # a checkpoint directory
    assert counted_in == str(tiny_model)
    assert tokenizer.to_str() == load_tokenizer(str(tiny_model)).to_str()
    # Neither a redserve model nor a Hub tokenizer (offline, or no such repository).
    assert model_tokenizer("no-such-model [x]")[1] == DEFAULT_MODEL
    # The vocabulary is decoded once per tokenizer, not once per sweep value.
    assert _word_ids(tokenizer) is _word_ids(tokenizer)


def test_random_prompts_have_exactly_the_asked_length(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    prompts = random_prompts(tokenizer, 20, 37, 5, "0/0")
    assert [count_tokens(tokenizer, p.text or "") for p in prompts] == [37] * 20
    assert len({p.text for p in prompts}) == 20 and {p.output_len for p in prompts} == {5}
    assert [p.text for p in random_prompts(tokenizer, 3, 37, 5, "0/0")] == [
        p.text for p in prompts[:3]]
    assert random_prompts(tokenizer, 1, 37, 5, "0/1")[0].text != prompts[0].text


def test_dataset_lines_and_their_errors(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Once upon a time", "output_len": 3}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    first, second, third = read_dataset(path, tokenizer, 7, 3, "chat")
    assert (first.text, first.output_len, first.input_tokens) == (
        "Once upon a time", 3, count_tokens(tokenizer, "Once upon a time"))
    assert second.messages == ({"role": "user", "content": "hi"},) and second.output_len == 7
    assert third == first  # a short file is reused in order
    with pytest.raises(BenchError, match="needs --endpoint chat"):
        read_dataset(path, tokenizer, 7, None, "completions")
    for line, problem in (('{"prompt": "x"}\nnot json', ":2: not JSON"),
                          ('{"prompt": "x", "output_len": 0}', "output_len"),
                          ('{"text": "x"}', '"prompt"'), ("[1]", "JSON object")):
        path.write_text(line)
        with pytest.raises(BenchError, match=problem):
            read_dataset(path, tokenizer, 7, None, "chat")
    with pytest.raises(BenchError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def _bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`redserve bench ...` with its output piped, as in CI or `| tee`."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "OPENAI_API_KEY")}
    return subprocess.run([sys.executable, "-m", "ops.cli", "bench", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_concurrency_sweep_against_a_real_stack(tiny_stack: Stack, tiny_model: Path,
                                                  tmp_path: Path) -> None:
    result_json, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    done = _bench(tiny_stack.base_url, "--tokenizer", str(tiny_model), "--input-len", "16",
                  "--output-len", "8", "--num-prompts", "6", "--concurrency", "1,3",
                  "--percentiles", "50,90", "--goodput", "ttft:60", "e2el:400",
                  "--result-json", str(result_json), "--plot", str(plot))
    assert done.returncode == 0, done.stdout + done.stderr
    doc: dict[str, Any] = json.loads(result_json.read_text())
    assert (doc["model"], doc["endpoint"]) == ("tiny-llama", "chat")
    assert doc["base_url"] == f"{tiny_stack.base_url}/v1"
    assert doc["settings"]["goodput_slos_ms"] == {"ttft": 60, "e2el": 400}
    assert [r["load"] for r in doc["runs"]] == [{"concurrency": 1}, {"concurrency": 3}]
    for run, concurrency in zip(doc["runs"], (1, 3), strict=True):
        records = run["requests"]
        assert (run["completed"], run["failed"], len(records)) == (6, 0, 6)
        # ignore_eos: every reply has exactly max_tokens tokens, as the server counted them
        assert [r["output_tokens"] for r in records] == [8] * 6
        assert run["total_output_tokens"] == 6 * 8
        # 16 prompt tokens plus the chat template, the same for every prompt
        assert len({r["input_tokens"] for r in records}) == 1 and records[0]["input_tokens"] > 16
        assert run["total_input_tokens"] == sum(r["input_tokens"] for r in records)
        assert run["peak_concurrency"] == concurrency
        assert run["output_throughput"] == pytest.approx(48 / run["duration_s"])
        for r in records:
            assert r["ok"] and 0 < r["ttft_s"] <= r["e2el_s"]
            assert r["tpot_s"] == pytest.approx((r["e2el_s"] - r["ttft_s"]) / 7)
            assert len(r["itl_s"]) >= 1 and all(g >= 0 for g in r["itl_s"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist = run[name]
            assert 0 < dist["p50_ms"] <= dist["p90_ms"] and dist["median_ms"] == dist["p50_ms"]
        assert run["ttft"]["median_ms"] < run["e2el"]["median_ms"]
        good = [r for r in records if r["ttft_s"] * 1000 <= 60 and r["e2el_s"] * 1000 <= 400]
        assert run["good_requests"] == len(good)
        assert run["goodput"] == pytest.approx(len(good) / run["duration_s"])
    assert plot.read_bytes()[:8] == PNG_MAGIC
    # Piped, the tables keep their width: the sweep's header is one line, not wrapped at 80.
    lines = done.stdout.splitlines()
    header = next(line for line in lines if "load" in line and "goodput req/s" in line)
    assert "TTFT P90" in header and "E2EL P90" in header and len(header.rstrip()) > 80
    assert sum("Serving benchmark: concurrency" in line for line in lines) == 2
    assert "━" in done.stdout and "\r" not in done.stdout  # tables, and no progress bar


def test_poisson_arrivals_from_a_dataset_on_completions(tiny_stack: Stack, tmp_path: Path
                                                        ) -> None:
    dataset, result_json = tmp_path / "prompts.jsonl", tmp_path / "rate.json"
    dataset.write_text("".join(json.dumps({"prompt": f"Story number {i}:", "output_len": i})
                               + "\n" for i in range(1, 6)))
    done = _bench(tiny_stack.base_url, "--dataset", str(dataset), "--endpoint", "completions",
                  "--request-rate", "50", "--max-concurrency", "2",
                  "--result-json", str(result_json))
    assert done.returncode == 0, done.stdout + done.stderr
    # No --tokenizer, and neither redserve nor the Hub knows "tiny-llama": the default
    # model's tokenizer counts the prompts, and the output says so.
    [warning] = [line for line in done.stdout.splitlines() if "no tokenizer found" in line]
    assert f"counted in {DEFAULT_MODEL}'s tokens" in warning and "--tokenizer" in warning
    document = json.loads(result_json.read_text())
    assert document["settings"]["tokenizer"] == DEFAULT_MODEL
    [run] = document["runs"]
    assert run["load"] == {"request_rate": 50.0, "max_concurrency": 2}
    assert [r["output_tokens"] for r in run["requests"]] == [1, 2, 3, 4, 5]
    assert run["peak_concurrency"] <= 2 and run["completed"] == 5
    assert run["requests"][0]["tpot_s"] is None  # one token: no time per output token


def test_failures_exit_non_zero_with_the_reason(tiny_stack: Stack, tiny_model: Path) -> None:
    tokenizer = ("--tokenizer", str(tiny_model), "--input-len", "8", "--output-len", "2")
    unreachable = _bench(f"http://127.0.0.1:{free_port()}", *tokenizer, timeout=60)
    assert unreachable.returncode == 1
    assert "cannot reach" in unreachable.stderr and "Traceback" not in unreachable.stderr
    # A 4xx on every request: said once, from the test request, before any load.
    # The server's message quotes the model's name, which reads as a closing markup tag.
    refused = _bench(tiny_stack.base_url, "--model", "no-such-model[/b]", *tokenizer,
                     timeout=60)
    assert refused.returncode == 1 and "404" in refused.stderr, refused.stderr
    assert "no-such-model[/b]" in refused.stderr and "Serving benchmark" not in refused.stdout
    bad_flag = _bench(tiny_stack.base_url, "--goodput", "latency:5", timeout=60)
    assert bad_flag.returncode == 2 and "NAME:MILLISECONDS" in bad_flag.stderr
    both = _bench(tiny_stack.base_url, "--concurrency", "2", "--max-concurrency", "2",
                  timeout=60)
    assert both.returncode == 2 and "--max-concurrency" in both.stderr
    help_text = _bench("--help", timeout=60).stdout
    for option in ("--concurrency", "--request-rate", "--goodput", "--plot", "--dataset"):
        assert option in help_text


def test_plot_without_matplotlib_fails_before_the_load() -> None:
    """With matplotlib not importable, --plot is refused at once (exit 2), before the server
    is asked anything: the URL here answers nothing, which would otherwise fail with exit 1."""
    hidden = ("import sys; sys.modules['matplotlib'] = None; from ops.cli import main; "
              "main(sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-c", hidden, "bench", f"http://127.0.0.1:{free_port()}",
                           "--plot", "out.png"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "--plot needs matplotlib" in line and "pip install 'redserve[bench]'" in line
