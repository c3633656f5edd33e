"""Adapters applied to their own rows of a step, beside the base rows.

A step packs every request's tokens into one sequence (`worker/engine/model_runner.py`). Each
linear runs once over all of them with the base weights, unchanged; then, for each adapter that
some request of the step names, its low-rank update is added to that adapter's rows only:
y[rows] += (x[rows] @ A^T) @ B^T (the grouped form of S-LoRA and Punica, here one small
multiply pair per adapter and linear). The rows of an adapter are found once per step, as a
slice where they are contiguous (a lone request, a run of chunks) and an index otherwise. A
step in which no request names an adapter has no `LoraStep` at all: the base rows pay one
`is None` test per linear.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from worker.engine.chunk import Chunk
from worker.engine.linear import Linear
from worker.engine.lora.adapter import LoraPair


@dataclass(frozen=True)
class _Group:
    pairs: Mapping[Linear, LoraPair]  # one adapter's
    rows: slice | torch.Tensor  # its rows of the step's packed tokens


class LoraStep:
    """One step's adapters and their rows."""

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups

    def add(self, linear: Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's update of `linear` to its rows of `y` (= linear(x)), in place."""
        for group in self.groups:
            pair = group.pairs.get(linear)
            if pair is None:  # a linear this adapter leaves alone, or the vocabulary's
                continue
            if isinstance(group.rows, slice):
                y[group.rows] += (x[group.rows] @ pair.a) @ pair.b
            else:
                y.index_add_(0, group.rows, (x.index_select(0, group.rows) @ pair.a) @ pair.b)


class Loras:
    """The adapters resident on a worker, by name."""

    def __init__(self, adapters: Mapping[str, Mapping[Linear, LoraPair]]) -> None:
        self.adapters = dict(adapters)

    def step(self, chunks: Sequence[Chunk], device: torch.device) -> LoraStep | None:
        """The adapters `chunks` name and their rows, or None when none names one."""
        rows: dict[str, list[int]] = {}
        start = 0
        for chunk in chunks:
            n = len(chunk.tokens)
            if chunk.lora:
                rows.setdefault(chunk.lora, []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        return LoraStep([_Group(self.adapters[name], _rows(ids, device))
                         for name, ids in rows.items()])


def _rows(ids: list[int], device: torch.device) -> slice | torch.Tensor:
    if ids[-1] - ids[0] + 1 == len(ids):  # ascending and contiguous
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.long, device=device)
