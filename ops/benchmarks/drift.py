"""What a change to the numbers (int8 weights, an fp8 KV cache) does to a model's output: its
prompts decoded greedily or teacher-forced on a reference's tokens, with the logprob of each
fed token and the argmax at each position. Shared by `ops.benchmarks.quantization` and
`ops.benchmarks.kv_fp8`, which compare such runs against a bf16 one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
