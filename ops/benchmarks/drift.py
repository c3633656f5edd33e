"""What a change to the numbers (int8 weights, an fp8 KV cache) does to a model's output: its
prompts decoded greedily or teacher-forced on a reference's tokens, with the logprob of each
fed token and the argmax at each position, and the figures that compare two runs. Shared by
`ops.benchmarks.quantization` and `ops.benchmarks.kv_fp8`, which compare such runs against a
bf16 one the same way."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import AutoTokenizer

from worker.engine.chunk import Chunk
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class Run:
    fed: list[list[int]]  # per prompt, the continuation fed back
    logprobs: list[list[float]]  # the logprob of each fed token
    top: list[list[int]]  # the argmax at each position


def decode(runner: ModelRunner, prompts: list[list[int]], tokens: int,
           forced: list[list[int]] | None = None) -> Run:
    """Every prompt in one batch, greedy or teacher-forced on `forced`, in pages of the
    runner's size."""
    page = runner.page_size
    per = -(-(max(map(len, prompts)) + tokens) // page)
    runner.attach(KVPool(runner.kv_shape, per * len(prompts), page))
    pages = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    run = Run([[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts])
    chunks = [Chunk(p, 0, pages[i], sample=True) for i, p in enumerate(prompts)]
    for t in range(tokens):
        logprobs = torch.log_softmax(runner.forward(chunks), -1)
        best = logprobs.argmax(-1).tolist()
        for i in range(len(prompts)):
            token = forced[i][t] if forced is not None else best[i]
            run.fed[i].append(token)
            run.logprobs[i].append(float(logprobs[i, token]))
            run.top[i].append(best[i])
        chunks = [Chunk([run.fed[i][t]], len(p) + t, pages[i], sample=True)
                  for i, p in enumerate(prompts)]
    return run


def shared(a: list[int], b: list[int]) -> int:
    """Tokens two continuations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def chat_prompts(path: Path, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat prompt, in the model's chat template."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return [list(cast(list[int], tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)))
            for q in questions]


def gap_cells(ours: Run, ref: Run) -> list[str]:
    """Mean, p99 and max |d| between the logprobs two runs gave the same fed tokens."""
    gaps = torch.tensor([abs(x - y) for a, b in zip(ours.logprobs, ref.logprobs, strict=True)
                         for x, y in zip(a, b, strict=True)])
    return [f"{float(gaps.mean()):.4f}", f"{float(gaps.quantile(0.99)):.3f}",
            f"{float(gaps.max()):.3f}"]


def top1(forced: Run, base: Run) -> str:
    """How often a run teacher-forced on `base`'s tokens has `base`'s token as its argmax."""
    hits = [x == y for a, b in zip(forced.top, base.fed, strict=True)
            for x, y in zip(a, b, strict=True)]
    return f"{sum(hits) / len(hits):.1%}"


def shared_cells(greedy: Run, base: Run) -> list[str]:
    """Of a run decoding greedily on its own: the mean tokens it shares with `base` before
    they part, and how many of its prompts it decodes identically."""
    together = [shared(a, b) for a, b in zip(greedy.fed, base.fed, strict=True)]
    return [f"{statistics.mean(together):.1f}",
            f"{sum(s == len(base.fed[0]) for s in together)}/{len(together)}"]
