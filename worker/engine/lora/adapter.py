"""An adapter's weights laid out for the forward pass: one low-rank pair per fused linear.

The forward pass fuses q/k/v into one linear and gate/up into another
(`worker/engine/model_runner.py`), so an adapter's update of a fused linear is its projections'
updates side by side: A stacks their A matrices ([sum of ranks, in]: the projections share
their input), and B places each projection's B in that projection's output columns and its own
rank's inputs, zeros elsewhere (a block diagonal). One (x A^T) B^T then gives every
projection's update in its own columns, and a projection the adapter does not target adds
nothing. The scaling (lora_alpha / rank) is folded into B once, at load. Both are stored
transposed and contiguous, [in, ranks] and [ranks, out], so that a step multiplies them
without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors.torch import load_file

from shared.lora import BaseShapes, LoraAdapter, LoraError, LoraModule
from worker.engine.linear import Linear

# Each fused linear's projections, in the order of its output columns.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class FusedLayer(Protocol):
    """A decoder layer's linears as the forward pass runs them."""

    @property
    def qkv(self) -> Linear: ...
    @property
    def o(self) -> Linear: ...
    @property
    def gate_up(self) -> Linear: ...
    @property
    def down(self) -> Linear: ...


@dataclass(frozen=True)
class LoraPair:
    """y += (x @ a) @ b for one fused linear: a is [in, ranks], b is [ranks, out], scaled."""

    a: torch.Tensor
    b: torch.Tensor


def load_adapter(adapter: LoraAdapter, base: BaseShapes, layers: Sequence[FusedLayer],
                 dtype: torch.dtype, device: torch.device) -> dict[Linear, LoraPair]:
    """The adapter's pairs, by the fused linear each updates (the linears it leaves alone have
    none). Its tensors are read with safetensors, then cast to the compute dtype."""
    return pair_up(adapter, load_file(str(adapter.weights)), base, layers, dtype, device)


def pair_up(adapter: LoraAdapter, tensors: dict[str, torch.Tensor], base: BaseShapes,
            layers: Sequence[FusedLayer], dtype: torch.dtype,
            device: torch.device) -> dict[Linear, LoraPair]:
    """`load_adapter` from its weights file's tensors, already read."""
    by_place = {(m.layer, m.target): m for m in adapter.modules}
    pairs: dict[Linear, LoraPair] = {}
    for i, layer in enumerate(layers):
        for fused, targets in FUSED.items():
            modules = [by_place.get((i, t)) for t in targets]
            if any(m is not None for m in modules):
                linear: Linear = getattr(layer, fused)
                pairs[linear] = _stack(adapter, base, linear, targets, modules, tensors,
                                       dtype, device)
    return pairs


def _stack(adapter: LoraAdapter, base: BaseShapes, linear: Linear, targets: tuple[str, ...],
           modules: list[LoraModule | None], tensors: dict[str, torch.Tensor],
           dtype: torch.dtype, device: torch.device) -> LoraPair:
    """One fused linear's pair (see the docstring)."""
    widths = [base.projections[t][1] for t in targets]
    if sum(widths) != linear.out_features or base.projections[targets[0]][0] != linear.in_features:
        raise LoraError(f"adapter {adapter.name!r}: the base model's {'/'.join(targets)} are "
                        f"[{linear.in_features} -> {linear.out_features}] here, not what its "
                        "config.json says")
    present = [m for m in modules if m is not None]
    ranks = sum(tensors[m.a].shape[0] for m in present)
    a = torch.cat([tensors[m.a].float() for m in present])  # [ranks, in]
    b = torch.zeros(linear.out_features, ranks)
    row, col = 0, 0
    for module, width in zip(modules, widths, strict=True):
        if module is not None:
            rank = tensors[module.a].shape[0]
            b[row : row + width, col : col + rank] = tensors[module.b].float() * adapter.scaling
            col += rank
        row += width
    return LoraPair(a.t().contiguous().to(device, dtype), b.t().contiguous().to(device, dtype))
