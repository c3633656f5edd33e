"""Which adapters a worker holds: loaded when a request names one, at most `--max-loras` at
once, the least recently used evicted to make room.

A request carries where its adapter lives (`GenerateRequest.lora_path`, set by the replica;
an adapter declared with the worker's `--lora` may go without). An adapter not resident is
read and checked on a reader thread of its own (`shared/lora.py`'s checks against this
worker's model and `--max-lora-rank`, then its weights file's bytes): no torch there, since
the worker runs every tensor operation on its one compute thread (docs/benchmarks.md). What
is left, parsing those bytes into tensors and laying them out in a slot of `Loras`
(worker/engine/lora/apply.py), is torch ops that `settle` runs on the compute thread between
steps, at most `LAY_OUT_BUDGET_S` at one boundary (a linear at a time: packing each one's
weights is most of a load's cost), so the other requests' steps go on while it loads.

Its requests wait in the scheduler's queue meanwhile (the scheduler admits a request only
once its adapter is resident). When every slot is taken, the least recently used adapter that
no running or waiting request names is evicted; when each is named by one, the read adapter
waits for one to free (its requests stay queued, not refused). An adapter that fails its
checks ends the requests waiting for it with the problem named, and nothing else.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load as parse_safetensors

from shared.lora import BaseShapes, LoraAdapter, LoraError, LoraSpec, read_adapters
from worker.engine.kernels import Kernels
from worker.engine.kv_cache import KVShape
from worker.engine.linear import Linear
from worker.engine.lora.adapter import FusedLayer, pair_up
from worker.engine.lora.apply import Loras

log = logging.getLogger("redserve.worker")

# Of laying adapters out, at most this much at one step boundary (on the compute thread, the
# other requests' steps wait for it): a load spreads over a few steps.
LAY_OUT_BUDGET_S = 0.01


class LoraHost(Protocol):
    """What adapters are laid out for and attached to: `worker/engine/model_runner.py`'s
    ModelRunner (its `loras` is what each step applies)."""

    loras: Loras | None

    @property
    def layers(self) -> Sequence[FusedLayer]: ...
    @property
    def kv_shape(self) -> KVShape: ...
    @property
    def kernels(self) -> Kernels: ...
    @property
    def device(self) -> torch.device: ...


@dataclass(frozen=True)
class LoraLimits:
    """What an adapter is checked against: the model it applies to, and the worker's limits."""

    model: str
    path: Path  # the base model's directory
    max_loras: int  # resident at once
    max_rank: int


@dataclass(frozen=True)
class _Read:
    """An adapter checked and its weights file read, off the compute thread."""

    adapter: LoraAdapter
    data: bytes
    seconds: float


@dataclass
class _Job:
    """An adapter being laid out in its reserved slot, some linears at each step boundary."""

    read: _Read
    slot: int
    linears: list[Linear]  # still to lay out (the evicted adapter's among them)
    spent: float  # on the compute thread so far


class Residency:
    """The worker's resident adapters, in `runner.loras` (None while there is none, so a step
    naming no adapter pays what it paid before adapters existed). Every method but the reader
    thread's runs on the compute thread or between steps."""

    def __init__(self, runner: LoraHost, limits: LoraLimits,
                 declared: dict[str, Path]) -> None:
        self.runner = runner
        self.limits = limits
        self.declared = declared  # --lora: preloaded, and loadable by name alone
        self.shapes = BaseShapes.read(limits.path)
        self.loras = Loras({}, native=runner.kernels.native)  # as the base linears
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident, least recent first
        self.resident: tuple[str, ...] = ()  # the same, replaced whole: any thread may read it
        self._reads: dict[str, Future[_Read]] = {}
        self._ready: dict[str, _Read] = {}  # read, waiting for a slot
        self._job: _Job | None = None  # the adapter being laid out, a few linears a step
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="redserve-lora-read")
        self.loads: Counter[str] = Counter()  # since start, preloads included
        self.evictions: Counter[str] = Counter()
        # Seconds since start: reading and checking (reader thread), laying out (compute
        # thread, between steps: what a load costs the other requests' steps).
        self.read_s = 0.0
        self.lay_out_s = 0.0

    def holds(self, name: str) -> bool:
        return name in self._lru

    @property
    def loading(self) -> bool:
        return bool(self._reads or self._ready or self._job)

    def preload(self, adapters: list[LoraAdapter]) -> None:
        """Load the first `max_loras` of `adapters` now (at start, checked already)."""
        for adapter in adapters[: self.limits.max_loras]:
            self._ready[adapter.name] = _Read(adapter, adapter.weights.read_bytes(), 0.0)
            job = self._next_job({adapter.name}, {})
            assert job is not None
            self._continue(job, math.inf)
            self._finish(job)

    def want(self, name: str, path: str = "") -> None:
        """A request names adapter `name`, at `path` ("": its declared one): it becomes the
        most recently used if resident, else is read in the background. LoraError when it is
        neither resident nor anywhere this worker knows of."""
        if name in self._lru:
            self._lru.move_to_end(name)
            self.resident = tuple(self._lru)
            return
        if name in self._reads or name in self._ready or (
                self._job is not None and self._job.read.adapter.name == name):
            return  # on its way
        where = Path(path) if path else self.declared.get(name)
        if where is None:
            raise LoraError(f"this worker holds no LoRA adapter {name!r}, and the request "
                            "does not say where it lives")
        self._reads[name] = self._reader.submit(self._read, LoraSpec(name, where))

    def _read(self, spec: LoraSpec) -> _Read:
        """On the reader thread: the adapter checked (no torch), and its weights' bytes."""
        start = time.perf_counter()
        read = read_adapters([spec], {self.limits.model: self.limits.path}, self.limits.max_rank)
        adapter = read[spec.name][1]
        try:
            data = adapter.weights.read_bytes()
        except OSError as e:
            raise LoraError(f"adapter {spec.name!r} ({spec.path}): {e}") from None
        return _Read(adapter, data, time.perf_counter() - start)

    def settle(self, in_use: set[str]) -> dict[str, str]:
        """Between steps: lay out the adapters read since, those that requests in `in_use`
        (the adapters the running and waiting requests name) still want, each in a free slot
        or the least recently used one's that none of them names; `LAY_OUT_BUDGET_S` of it
        at most, the rest at the next steps. The adapters that failed, with the problem."""
        failed: dict[str, str] = {}
        for name, future in list(self._reads.items()):
            if future.done():
                del self._reads[name]
                try:
                    self._ready[name] = future.result()
                except (LoraError, OSError) as e:
                    failed[name] = str(e)
        deadline = time.perf_counter() + LAY_OUT_BUDGET_S
        while True:
            if self._job is None:
                self._job = self._next_job(in_use, failed)
                if self._job is None:
                    break
            if not self._continue(self._job, deadline):
                break
            self._finish(self._job)
            self._job = None
        return failed

    def wait(self, timeout: float) -> None:
        """Block (nothing else to run) until a read ends, or `timeout` seconds."""
        if self._reads:
            wait(list(self._reads.values()), timeout, FIRST_COMPLETED)

    def _next_job(self, in_use: set[str], failed: dict[str, str]) -> _Job | None:
        """The next adapter read to lay out, its slot reserved (a victim's freed), or None."""
        for name, read in list(self._ready.items()):
            if name not in in_use:  # its requests ended while it was read
                del self._ready[name]
                continue
            full = len(self._lru) >= self.limits.max_loras
            victim = next((n for n in self._lru if n not in in_use), None) if full else None
            if full and victim is None:
                return None  # every resident adapter is named: wait for one to free
            del self._ready[name]
            start = time.perf_counter()
            try:
                pairs = pair_up(read.adapter, parse_safetensors(read.data), self.shapes,
                                self.runner.layers, self.runner.kv_shape.dtype,
                                self.runner.device)
            except LoraError as e:
                failed[name] = str(e)
                continue
            stale = self._evict(victim) if victim is not None else []
            return _Job(read, self.loras.reserve(pairs), [*dict.fromkeys([*stale, *pairs])],
                        time.perf_counter() - start)
        return None

    def _continue(self, job: _Job, deadline: float) -> bool:
        """Lay `job`'s linears out until `deadline`; whether all are."""
        start = time.perf_counter()
        while job.linears:
            self.loras.lay_out([job.linears.pop()])
            if time.perf_counter() >= deadline:
                break
        job.spent += time.perf_counter() - start
        return not job.linears

    def _evict(self, victim: str) -> list[Linear]:
        """Free `victim`'s slot; the linears to lay out again before it is reused."""
        del self._lru[victim]
        stale = self.loras.free(victim)
        self.evictions[victim] += 1
        self._attach()
        log.info("LoRA adapter %s evicted (least recently used of %d)", victim,
                 self.limits.max_loras)
        return stale

    def _finish(self, job: _Job) -> None:
        adapter = job.read.adapter
        self.loras.admit(adapter.name, job.slot)
        self._lru[adapter.name] = None
        self.loads[adapter.name] += 1
        self._attach()
        self.read_s += job.read.seconds
        self.lay_out_s += job.spent
        log.info("LoRA adapter %s loaded (rank %d, %d projections): read in %.0f ms, laid "
                 "out in %.0f ms", adapter.name, adapter.rank, len(adapter.modules),
                 job.read.seconds * 1000, job.spent * 1000)

    def _attach(self) -> None:
        self.runner.loras = self.loras if self.loras.slots else None
        self.resident = tuple(self._lru)
