"""The LoRA adapters loaded at run time, as one replica sees them: its copy of the model's
adapter registry in Redis (`shared.keys`: `{prefix}:model:{<model>}:loras`, records typed in
`shared.messages.loras`), which `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(`api/endpoints/lora_adapters.py`) write on any replica.

Every replica must serve the same set, yet none is told of a change: each reads the whole
registry every `LORA_REFRESH_S` (one HGETALL of a hash of at most `MAX_RUNTIME_LORAS` small
records), and a name it does not know is looked up in the registry (one HGET) before it
answers 404, so a request for an adapter just loaded elsewhere is served at once. What stays
stale, for at most `LORA_REFRESH_S` (plus a Redis round trip), is another replica's unload: its
requests are still queued here meanwhile, as requests already running run on to their end.

The registry has no TTL: an entry goes when its adapter is unloaded. Entries a replica cannot
serve (another model's name, a clash with a model or declared adapter of its own: replicas
started with different `--lora`) are left out of its view and logged once each.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import cast

import redis.asyncio as aioredis

from api.protocol.served_model import ServedModel
from api.queue.metrics import APIMetrics
from shared.keys import Keys
from shared.messages import RuntimeLora

log = logging.getLogger("redserve.api")

# How often a replica rereads the registry: the staleness of another replica's unload.
LORA_REFRESH_S = 2.0
# The most adapters the registry of one model holds (a load past it is refused): bounds each
# refresh and the per-adapter metrics' series.
MAX_RUNTIME_LORAS = 256


class LoraRegistry:
    """This replica's view of the runtime adapters over its one model (none when it serves
    several: adapters need a single base, `shared/lora.py`)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, models: dict[str, ServedModel],
                 declared: dict[str, ServedModel], metrics: APIMetrics) -> None:
        self.redis = redis
        self.keys = keys
        self.base = next(iter(models.values())) if len(models) == 1 else None
        self.models = models
        self.declared = declared
        self.metrics = metrics
        self.taken = {*models, *declared}  # names no runtime adapter may have here
        self.adapters: dict[str, ServedModel] = {}
        self.records: dict[str, RuntimeLora] = {}
        self._refused: set[str] = set()  # registry entries this replica said it cannot serve
        self._writes = 0  # this replica's loads and unloads: a refresh read before one is stale
        self._publish()

    def get(self, name: str) -> ServedModel | None:
        return self.adapters.get(name)

    async def lookup(self, name: str) -> ServedModel | None:
        """The runtime adapter `name`, from this replica's view or else from the registry
        (one that another replica has just loaded)."""
        known = self.adapters.get(name)
        if known is not None or self.base is None or name in self.taken:
            return known
        raw = await self.redis.hget(self._key, name)
        if raw is None:
            return None
        self._take({name: cast(bytes, raw)}, keep=True)
        return self.adapters.get(name)

    async def run(self) -> None:
        """Rereads the registry every `LORA_REFRESH_S`, for as long as the replica serves."""
        if self.base is None:
            return
        while True:
            try:
                await self.refresh()
            except aioredis.RedisError as e:
                log.warning("LoRA registry unavailable (the view is kept): %s", e)
            await asyncio.sleep(LORA_REFRESH_S)

    async def refresh(self) -> None:
        """The view, from the whole registry; dropped if this replica loaded or unloaded an
        adapter while it was read (it may predate that)."""
        writes = self._writes
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(self._key))
        if writes == self._writes:
            self._take({k.decode(): v for k, v in raw.items()}, keep=False)

    async def add(self, record: RuntimeLora) -> bool:
        """Writes `record` to the registry and this view; False if the name is taken there.
        The size is checked before the write, so concurrent loads may pass the bound by as
        many as they are."""
        if await self.redis.hlen(self._key) >= MAX_RUNTIME_LORAS:
            raise RegistryFull(MAX_RUNTIME_LORAS)
        self._writes += 1
        if not await self.redis.hsetnx(self._key, record.name, record.to_json()):
            return False
        self._take({record.name: record.to_json()}, keep=True)
        return True

    async def remove(self, name: str) -> bool:
        """Deletes `name` from the registry and this view; False if the registry had none."""
        self._writes += 1
        removed = bool(await self.redis.hdel(self._key, name))
        if self.adapters.pop(name, None) is not None:
            self.records.pop(name, None)
            self._publish()
        return removed

    @property
    def _key(self) -> str:
        assert self.base is not None
        return self.keys.loras(self.base.base)

    def _take(self, raw: dict[str, bytes], keep: bool) -> None:
        """The view from registry entries: those added (`keep`), or the whole registry."""
        assert self.base is not None
        records = dict(self.records) if keep else {}
        for name, value in raw.items():
            try:
                record = RuntimeLora.from_json(value)
            except ValueError as e:
                self._refuse(name, str(e))
                continue
            if record.base != self.base.base or name != record.name or name in self.taken:
                self._refuse(name, f"for model {record.base!r}, or a name this replica serves")
                continue
            records[name] = record
        if records != self.records:
            self.records = records
            self.adapters = {name: replace(self.base, lora=r.adapter)
                             for name, r in records.items()}
            self._publish()

    def _refuse(self, name: str, why: str) -> None:
        if name not in self._refused:
            self._refused.add(name)
            log.warning("LoRA registry entry %r left out on this replica: %s", name[:128], why)

    def _publish(self) -> None:
        """The metrics count the names served now, and only those."""
        served = [*self.models.values(), *self.declared.values(), *self.adapters.values()]
        self.metrics.serve_adapters({(m.base, m.name) for m in served})


class RegistryFull(Exception):
    def __init__(self, bound: int) -> None:
        super().__init__(f"the registry holds {bound} adapters, the most it may: unload one "
                         "first")
