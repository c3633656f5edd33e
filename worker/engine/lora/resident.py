"""Which adapters a worker holds: loaded when a request names one, at most `--max-loras` at
once, the least recently used evicted to make room.

A request carries where its adapter lives (`GenerateRequest.lora_path`, set by the replica;
an adapter declared with the worker's `--lora` may go without). An adapter not resident is
read and checked on a reader thread of its own (`shared/lora.py`'s checks against this
worker's model and `--max-lora-rank`, then its weights file's bytes): no torch there, since
the worker runs every tensor operation on its one compute thread (docs/benchmarks.md). What
is left, parsing those bytes into tensors and laying them out in a slot of `Loras`
(worker/engine/lora/apply.py), is a few torch ops that `settle` runs on the compute thread
between steps, so the other requests' steps go on while the files are read.

Its requests wait in the scheduler's queue meanwhile (the scheduler admits a request only
once its adapter is resident). When every slot is taken, the least recently used adapter that
no running or waiting request names is evicted; when each is named by one, the read adapter
waits for one to free (its requests stay queued, not refused). An adapter that fails its
checks ends the requests waiting for it with the problem named, and nothing else.
"""

from __future__ import annotations

import logging
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
from worker.engine.lora.adapter import FusedLayer, pair_up
from worker.engine.lora.apply import Loras

log = logging.getLogger("redserve.worker")


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
        return bool(self._reads or self._ready)

    def preload(self, adapters: list[LoraAdapter]) -> None:
        """Load the first `max_loras` of `adapters` now (at start, checked already)."""
        for adapter in adapters[: self.limits.max_loras]:
            self._lay_out(_Read(adapter, adapter.weights.read_bytes(), 0.0))

    def want(self, name: str, path: str = "") -> None:
        """A request names adapter `name`, at `path` ("": its declared one): it becomes the
        most recently used if resident, else is read in the background. LoraError when it is
        neither resident nor anywhere this worker knows of."""
        if name in self._lru:
            self._lru.move_to_end(name)
            self.resident = tuple(self._lru)
            return
        if name in self._reads or name in self._ready:
            return
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
        or the least recently used one's that none of them names. The adapters that failed,
        with the problem."""
        failed: dict[str, str] = {}
        for name, future in list(self._reads.items()):
            if future.done():
                del self._reads[name]
                try:
                    self._ready[name] = future.result()
                except (LoraError, OSError) as e:
                    failed[name] = str(e)
        for name, read in list(self._ready.items()):
            if name not in in_use:  # its requests ended while it was read
                del self._ready[name]
                continue
            if len(self._lru) >= self.limits.max_loras and not self._evict(in_use):
                break  # every resident adapter is named: wait for one to free
            del self._ready[name]
            try:
                self._lay_out(read)
            except LoraError as e:
                failed[name] = str(e)
        return failed

    def wait(self, timeout: float) -> None:
        """Block (nothing else to run) until a read ends, or `timeout` seconds."""
        if self._reads:
            wait(list(self._reads.values()), timeout, FIRST_COMPLETED)

    def _evict(self, in_use: set[str]) -> bool:
        victim = next((name for name in self._lru if name not in in_use), None)
        if victim is None:
            return False
        del self._lru[victim]
        self.loras.drop(victim)
        self.evictions[victim] += 1
        self._attach()
        log.info("LoRA adapter %s evicted (least recently used of %d)", victim,
                 self.limits.max_loras)
        return True

    def _lay_out(self, read: _Read) -> None:
        start = time.perf_counter()
        adapter = read.adapter
        pairs = pair_up(adapter, parse_safetensors(read.data), self.shapes, self.runner.layers,
                        self.runner.kv_shape.dtype, self.runner.device)
        self.loras.put(adapter.name, pairs)
        self._lru[adapter.name] = None
        self.loads[adapter.name] += 1
        self._attach()
        took = time.perf_counter() - start
        self.read_s += read.seconds
        self.lay_out_s += took
        log.info("LoRA adapter %s loaded (rank %d, %d projections): read in %.0f ms, laid "
                 "out in %.0f ms", adapter.name, adapter.rank, len(adapter.modules),
                 read.seconds * 1000, took * 1000)

    def _attach(self) -> None:
        self.runner.loras = self.loras if self.loras.slots else None
        self.resident = tuple(self._lru)
