"""Which grammar library should constrain `response_format` and tool calls: measured, not guessed.

    python -m ops.benchmarks.grammar_libraries [--model SmolLM2-135M-Instruct] [--reps 5]

Structured output costs the server in three places: once per tokenizer (building the library's
view of the vocabulary), once per request schema (compiling it into a matcher; a cache can hide
this for repeated schemas) and once per generated token (the mask of allowed next tokens, which
sits on the decode step's critical path for every constrained row of the batch). This benchmark
puts llguidance, xgrammar and outlines-core side by side on the served model's real tokenizer
and on three schemas the API sees: a bare json_object, a pydantic `model_json_schema()` as
`client.chat.completions.parse` sends it, and a tool call with a const name.

Per token, a valid document is tokenized by the HF tokenizer and walked: mask, check that the
document's token is allowed (so a wrong mask cannot look fast), advance. Each walk starts from a
fresh matcher, as a new request would, so work a library defers to first use is counted. A
batch step fills the masks of 8 or 32 matchers (the three schemas mixed, at staggered positions)
through the library's batch API where it has one, and through a plain loop for comparison. The
machine is small and noisy: every figure is the median of several runs. Timings include the
thin Python wrapper each library puts around its native call, as the server would pay it.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import importlib.metadata as md
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from packaging.requirements import Requirement
from pydantic import BaseModel
from rich.markup import escape
from rich.table import Table

from ops.benchmarks.machine import describe
from ops.console import make_console
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

HEAVY_MB = 20  # a runtime requirement installed at this size or more is named as heavy


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Reading(BaseModel):
    day: str
    high: int
    low: int


class Forecast(BaseModel):
    city: str
    unit: Unit
    days: int
    readings: list[Reading]
    note: str | None = None


ARGUMENTS = {"type": "object", "additionalProperties": False, "required": ["location", "unit"],
             "properties": {"location": {"type": "string"},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
               "properties": {"name": {"const": "get_weather"}, "arguments": ARGUMENTS}}
FORECAST = Forecast(city="Paris", unit=Unit.celsius, days=3, note=None, readings=[
    Reading(day="Mon", high=21, low=12), Reading(day="Tue", high=19, low=11),
    Reading(day="Wed", high=23, low=14)])
# (name, schema, a valid instance) with the separators models usually print: ", " and ": ".
SCHEMAS: list[tuple[str, dict[str, Any], str]] = [
    ("json_object", {"type": "object"}, json.dumps(
        {"id": 17, "name": "Ada Lovelace", "tags": ["math", "poetry"], "score": 9.5,
         "active": True, "address": {"city": "London", "zip": None}})),
    ("pydantic nested", Forecast.model_json_schema(), json.dumps(FORECAST.model_dump(mode="json"))),
    ("tool call", TOOL_SCHEMA, json.dumps(
        {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}})),
]

WARM_UP = ("warm-up", {"type": "object", "properties": {"a": {"type": "string"}}}, '{"a": "x"}')


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


class Backend:
    """One library behind the handful of calls the benchmark makes."""

    dist = ""
    batch_api = "loop"
    warm_cache = False

    def __init__(self, hf_tok: Any) -> None:
        self.hf_tok = hf_tok
        self.lib: Any = importlib.import_module(self.dist.replace("-", "_"))
        self.vocab = len(hf_tok)

    # setup builds the library's view of the tokenizer (timed); the rest wrap one call each
    def setup(self) -> None: raise NotImplementedError
    def compile(self, schema: dict[str, Any], cold: bool) -> Any: raise NotImplementedError
    def matcher(self, compiled: Any) -> Any: raise NotImplementedError
    def fill(self, m: Any, mask: Any, i: int) -> None: raise NotImplementedError
    def consume(self, m: Any, token: int) -> bool: raise NotImplementedError

    def reset(self, m: Any) -> None:
        m.reset()

    def alloc(self, n: int) -> Any:
        return np.full((n, (self.vocab + 31) // 32), -1, dtype=np.int32)

    def batch_fill(self, ms: list[Any], mask: Any) -> None:
        for i, m in enumerate(ms):
            self.fill(m, mask, i)


class LLGuidance(Backend):
    dist = "llguidance"
    batch_api = "LLExecutor par"

    def setup(self) -> None:
        self.tok = importlib.import_module("llguidance.hf").from_tokenizer(self.hf_tok)
        self.np: Any = importlib.import_module("llguidance.numpy")
        self.executor = self.lib.LLExecutor(num_threads=os.cpu_count())

    def compile(self, schema: dict[str, Any], cold: bool) -> Any:
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        m = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.lib.LLMatcher(self.tok, compiled, log_level=0)

    def fill(self, m: Any, mask: Any, i: int) -> None:
        self.np.fill_next_token_bitmask(m, mask, i)

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()

    def batch_fill(self, ms: list[Any], mask: Any) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                            mask)


class XGrammar(Backend):
    dist = "xgrammar"
    batch_api = "BatchGrammarMatcher"
    warm_cache = True

    def setup(self) -> None:
        self.info = self.lib.TokenizerInfo.from_huggingface(self.hf_tok, vocab_size=self.vocab)
        self.compiler = self.lib.GrammarCompiler(self.info)
        self.batcher = self.lib.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)

    def compile(self, schema: dict[str, Any], cold: bool) -> Any:
        compiler = self.lib.GrammarCompiler(self.info) if cold else self.compiler
        return compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def alloc(self, n: int) -> Any:
        return self.lib.allocate_token_bitmask(n, self.vocab)

    def fill(self, m: Any, mask: Any, i: int) -> None:
        m.fill_next_token_bitmask(mask, i)

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def batch_fill(self, ms: list[Any], mask: Any) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, mask)


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte as one printable character: the inverse map."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    out.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return out


class OutlinesCore(Backend):
    dist = "outlines-core"

    def setup(self) -> None:
        decode = _byte_decoder()
        special = set(self.hf_tok.all_special_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for text, tid in self.hf_tok.get_vocab().items():
            if tid in special:  # control tokens must never satisfy a JSON string
                continue
            raw = bytes(decode[c] for c in text) if all(c in decode for c in text) \
                else text.encode()
            by_bytes.setdefault(raw, []).append(tid)
        self.vocabulary = self.lib.Vocabulary(self.hf_tok.eos_token_id, by_bytes)

    def compile(self, schema: dict[str, Any], cold: bool) -> Any:
        regex = self.lib.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.lib.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.lib.Guide(compiled)

    def fill(self, m: Any, mask: Any, i: int) -> None:
        m.write_mask_into(mask[i].ctypes.data, mask.shape[1], 4)

    def consume(self, m: Any, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except Exception:
            return False
        return True


def _median_s(fn: Callable[[], object], reps: int, budget_s: float = 2.0) -> tuple[float, int]:
    """The median wall time of `fn` over up to `reps` runs; fewer once `budget_s` is spent."""
    times: list[float] = []
    while len(times) < reps and (not times or sum(times) < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def _walk(be: Backend, compiled: Any, tokens: list[int], eos: int) -> dict[str, float]:
    """One fresh matcher through `tokens`: per-token mask and advance times (µs), checked."""
    m, mask = be.matcher(compiled), be.alloc(1)
    rows = np.asarray(mask)  # a view: torch CPU tensors share their memory
    fills: list[float] = []
    advances: list[float] = []
    for k, token in enumerate([*tokens, eos]):
        t0 = time.perf_counter_ns()
        be.fill(m, mask, 0)
        fills.append((time.perf_counter_ns() - t0) / 1e3)
        if not _allowed(rows[0], token):
            what = "EOS" if k == len(tokens) else f"token {k} {be.hf_tok.decode([token])!r}"
            raise ValueError(f"mask rejects {what}")
        if k == len(tokens):
            break
        t0 = time.perf_counter_ns()
        ok = be.consume(m, token)
        advances.append((time.perf_counter_ns() - t0) / 1e3)
        if not ok:
            raise ValueError(f"matcher refused token {k}")
    return {"first": fills[0], "mean": statistics.fmean(fills),
            "p99": float(np.percentile(fills, 99)), "advance": statistics.fmean(advances)}


def _batch(be: Backend, work: list[tuple[Any, list[int]]], n: int, steps: int, reps: int,
           native: bool) -> float:
    """µs per step to fill `n` masks, the matchers cycling through `work` at staggered points."""
    per_run: list[float] = []
    for _ in range(reps):
        ms = [be.matcher(work[i % len(work)][0]) for i in range(n)]
        docs = [work[i % len(work)][1] for i in range(n)]
        pos = [0] * n
        for i, m in enumerate(ms):  # stagger: matcher i starts i tokens into its document
            for t in docs[i][: i % len(docs[i])]:
                be.consume(m, t)
            pos[i] = i % len(docs[i])
        mask = be.alloc(n)
        total = 0
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            if native:
                be.batch_fill(ms, mask)
            else:
                Backend.batch_fill(be, ms, mask)
            total += time.perf_counter_ns() - t0
            for i, m in enumerate(ms):
                if pos[i] == len(docs[i]):
                    be.reset(m)
                    pos[i] = 0
                be.consume(m, docs[i][pos[i]])
                pos[i] += 1
        per_run.append(total / steps / 1e3)
    return statistics.median(per_run)


def _first_use(be: Backend, tokens: list[int]) -> float:
    """Seconds for one-off work (lazy tables) that the first schema of a process would pay."""
    t0 = time.perf_counter()
    _walk(be, be.compile(WARM_UP[1], cold=True), tokens, be.hf_tok.eos_token_id)
    return time.perf_counter() - t0


def _installed_mb(dist: str) -> float:
    try:
        return sum(f.size or 0 for f in md.files(dist) or []) / 2**20
    except md.PackageNotFoundError:
        return 0.0


def _requires(dist: str) -> tuple[str, str]:
    """Runtime requirements on this platform (extras left out), the heavy ones with their
    installed size; and the library's own installed size."""
    names = []
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            mb = _installed_mb(req.name)
            names.append(f"{req.name} ({mb:.0f} MB)" if mb >= HEAVY_MB else req.name)
    return ", ".join(names) or "none", f"{_installed_mb(dist):.1f}"


def _schema_cells(be: Backend, schema: dict[str, Any], tokens: list[int],
                  reps: int) -> tuple[list[str], Any]:
    """The table cells of one library on one schema, and the compiled grammar (None on error)."""
    try:
        cold_s, n = _median_s(lambda: be.compile(schema, cold=True), 3)
        compiled = be.compile(schema, cold=False)
        warm = "no cache"
        if be.warm_cache:
            warm_s, _ = _median_s(lambda: be.compile(schema, cold=False), 3)
            warm = f"{warm_s * 1e3:.3f}"
        walks = [_walk(be, compiled, tokens, be.hf_tok.eos_token_id) for _ in range(reps)]
    except Exception as e:  # a schema the library cannot handle is a finding, not a crash
        return ["-"] * 6 + [f"[red]{escape(str(e)[:70])}"], None
    med = {k: statistics.median(w[k] for w in walks) for k in walks[0]}
    return [f"{cold_s * 1e3:.1f}" + (f" (n={n})" if n < 3 else ""), warm,
            *(f"{med[k]:.1f}" for k in ("first", "mean", "p99", "advance")), "ok"], compiled


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--reps", type=int, default=5, help="runs per figure; the median is shown")
    p.add_argument("--steps", type=int, default=100, help="batch steps per run")
    args = p.parse_args(argv)
    console = make_console()
    from transformers import AutoTokenizer

    info = resolve_model(args.model, Settings().cache_dir)
    hf_tok = AutoTokenizer.from_pretrained(str(info.path))
    console.print(describe())
    console.print(f"model {info.name}: tokenizer {type(hf_tok).__name__}, vocab {len(hf_tok)}, "
                  f"eos {hf_tok.eos_token_id}; {args.reps} runs per figure, median shown")
    docs = {name: hf_tok.encode(doc, add_special_tokens=False)
            for name, _, doc in [*SCHEMAS, WARM_UP]}

    libs = Table("library", "version", "tokenizer setup ms", "first use ms",
                 f"runtime requires (size if >= {HEAVY_MB} MB)", "installed MB", title="libraries")
    per = Table("library", "schema", "tokens", "compile cold ms", "compile warm ms", "1st mask µs",
                "mask mean µs", "mask p99 µs", "advance mean µs", "check",
                title="per schema: compile, then a walk over a valid document (µs per token)")
    bat = Table("library", "batch API", "B=8 API", "B=32 API", "B=8 loop", "B=32 loop",
                "B=32 API µs/row",
                title="batch: masks for B matchers in one step, schemas mixed (µs per step)")
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            be = cls(hf_tok)
            setup_s, _ = _median_s(be.setup, min(args.reps, 3))
            first_s = _first_use(be, docs["warm-up"])
        except Exception as e:  # a library that is absent or broken is reported, not fatal
            libs.add_row(cls.dist, "-", escape(f"failed: {e!r}"[:80]), "-", "-", "-")
            continue
        libs.add_row(cls.dist, md.version(cls.dist), f"{setup_s * 1e3:.0f}",
                     f"{first_s * 1e3:.1f}", *_requires(cls.dist))
        work = []
        for name, schema, _ in SCHEMAS:
            cells, compiled = _schema_cells(be, schema, docs[name], args.reps)
            per.add_row(cls.dist, name, str(len(docs[name])), *cells)
            if compiled is not None:
                work.append((compiled, docs[name]))
        if not work:
            bat.add_row(cls.dist, be.batch_api, "-", "-", "-", "-", "-")
            continue
        figs = {(n, native): _batch(be, work, n, args.steps, args.reps, native)
                for native in (True, False) for n in (8, 32)}
        bat.add_row(cls.dist, be.batch_api, *(f"{figs[k]:.0f}" for k in
                                              ((8, True), (32, True), (8, False), (32, False))),
                    f"{figs[(32, True)] / 32:.1f}")
    console.print(libs)
    console.print(per)
    console.print(bat)
    console.print("first use: one-off work the first schema in a process pays (compile and walk "
                  "a one-string object), kept out of the rows below. "
                  "compile cold: the schema from nothing (xgrammar: a fresh compiler, its cache "
                  "empty); warm: the same schema again through the library's own cache. check: "
                  "every document token and the final EOS were allowed by the mask.")


if __name__ == "__main__":
    main()
