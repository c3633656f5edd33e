"""Next-token choice for each request of a batch, each with its own parameters and generator."""

from __future__ import annotations

import torch

from shared.messages import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """`logits` is [batch, vocab] in fp32; returns one token id per row."""
    out: list[int] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.temperature == 0.0 or gen is None:
            out.append(int(torch.argmax(row)))
            continue
        scores = row / p.temperature
        if p.top_k > 0 and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
