"""Prefix-aware placement: which worker a new request should run on.

Every worker has its own prefix cache, so a request whose prompt starts like one a worker has
already run computes only its new tokens there, and everything elsewhere. Each worker announces
the public digests of the pages it caches (`PrefixSummary`, see worker/broker/presence.py); one task
per replica keeps a view of each served model's live workers (heartbeats, and summaries
re-read only when a heartbeat's version says they changed), refreshed about once a second, so
placing a request costs no Redis command: only hashing its prompt's pages (shared/page_digest.py).

A request goes to the live worker holding the longest cached prefix of its prompt (whole
pages, same tenant), unless that worker has no room (running + waiting, plus what this replica
placed on it since the view was read, reaches its capacity): then to the least loaded, as does
a request that matches nowhere. A miss's choice is remembered for its prompt's pages for a
short while, so that a burst sharing a new prefix lands on one worker before any summary shows
it.

A request naming a LoRA adapter prefers a worker holding it (its heartbeat lists the adapters
it holds: worker/engine/lora/resident.py), as a prefix hit is preferred: the holder with room
that holds the longest prefix (the least loaded of equals) takes it; when no holder has room,
or none holds it, the least loaded does, and loads the adapter (a cold load, against queue
depth). That choice too is remembered for a short while, so that a burst naming an adapter
no worker holds loads it on one worker.

The choice is only a preference: the take script lets any worker take a placed request once its
worker is gone or after `placement_wait_s` (worker/broker/take.py), so a stale view costs a
cache miss (or an adapter's load), never a request. With no live worker in view, nothing is placed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import redis.asyncio as aioredis

from api.queue.metrics import APIMetrics
from shared.keys import Keys
from shared.messages import Heartbeat, PrefixSummary
from shared.page_digest import prompt_digests

log = logging.getLogger("redserve.api.placement")

REFRESH_S = 1.0
# Remembered misses: at most this many pages, each for the time a summary takes to show it.
MAX_REMEMBERED = 65_536

Outcome = Literal["hit", "miss", "overloaded", "adapter"]


@dataclass
class WorkerView:
    name: str
    beat: Heartbeat
    summary: PrefixSummary | None
    placed: int = 0  # placed here by this replica since the view was read

    @property
    def load(self) -> int:
        return self.beat.running + self.beat.waiting + self.placed

    @property
    def has_room(self) -> bool:
        return self.load < self.beat.capacity


@dataclass
class Placement:
    redis: aioredis.Redis
    keys: Keys
    models: Sequence[str]
    mode: Literal["prefix", "random", "none"]
    metrics: APIMetrics
    remember_s: float  # how long a miss's choice stands in for a summary that lacks it
    views: dict[str, list[WorkerView]] = field(default_factory=dict)  # by model
    # (model, page digest) -> (worker, until when): recent misses' choices.
    _recent: dict[tuple[str, bytes], tuple[str, float]] = field(default_factory=dict)
    # (model, adapter) -> (worker, until when): recent cold loads' choices.
    _recent_loras: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)

    async def run(self) -> None:
        """Keep the view fresh until cancelled; a failed refresh keeps the last view."""
        if self.mode == "none":
            return
        while True:
            try:
                await self.refresh()
            except aioredis.RedisError as e:
                log.warning("placement: could not read the workers: %s", e)
            except Exception:
                log.exception("placement: could not read the workers")
            await asyncio.sleep(REFRESH_S)

    async def refresh(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for model in self.models:
            pipe.zrangebyscore(self.keys.workers(model), now, "+inf")
        found = [[_text(n) for n in names] for names in await pipe.execute()]
        names = [n for names in found for n in names]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.get(self.keys.worker(name))
        beats = dict(zip(names, await pipe.execute(), strict=True))
        known = {v.name: v.summary for views in self.views.values() for v in views}
        views: dict[str, list[WorkerView]] = {}
        stale = []
        for model, model_names in zip(self.models, found, strict=True):
            views[model] = []
            for name in model_names:
                beat = _beat(beats[name])
                if beat is None or beat.draining or beat.model != model:
                    continue
                summary = known.get(name)
                if summary is None or summary.version != beat.prefix_version:
                    summary = None
                    stale.append(name)
                views[model].append(WorkerView(name, beat, summary))
        if self.mode == "prefix" and stale:
            pipe = self.redis.pipeline(transaction=False)
            for name in stale:
                pipe.get(self.keys.prefixes(name))
            read = {n: _summary(raw) for n, raw in zip(stale, await pipe.execute(), strict=True)}
            for view in (v for vs in views.values() for v in vs):
                view.summary = read.get(view.name, view.summary)
        self.views = views
        self._recent = {k: v for k, v in self._recent.items() if v[1] > now}
        self._recent_loras = {k: v for k, v in self._recent_loras.items() if v[1] > now}

    def place(self, model: str, tenant: str, prompt: Sequence[int], lora: str = "") -> str:
        """The worker to run this prompt (under LoRA adapter `lora`, "" for none) on, or ""
        for any."""
        views = self.views.get(model)
        if self.mode == "none" or not views:
            return ""
        if self.mode == "random":
            return self._placed(random.choice(views))
        if lora:
            holders = [v for v in views if v.has_room and self._holds(model, v, lora)]
            if holders:
                best, matched, _ = self._longest_prefix(model, holders, tenant, prompt, lora)
                self.metrics.placements.labels(model, "hit" if matched else "adapter").inc()
                return self._placed(best or min(holders, key=lambda v: v.load))
        best, matched, digests = self._longest_prefix(model, views, tenant, prompt, lora)
        if best is not None and matched and best.has_room:
            self.metrics.placements.labels(model, "hit").inc()
            return self._placed(best)
        least = min(views, key=lambda v: (v.load - v.beat.capacity, v.load))
        self.metrics.placements.labels(model, "overloaded" if matched else "miss").inc()
        if lora and len(self._recent_loras) < MAX_REMEMBERED:  # it loads the adapter there
            self._recent_loras[(model, lora)] = (least.name, time.time() + self.remember_s)
        if not matched and len(self._recent) < MAX_REMEMBERED:
            until = time.time() + self.remember_s
            for digest in digests:
                self._recent[(model, digest)] = (least.name, until)
        return self._placed(least)

    def _longest_prefix(self, model: str, views: list[WorkerView], tenant: str,
                        prompt: Sequence[int],
                        lora: str) -> tuple[WorkerView | None, int, list[bytes]]:
        """The worker holding the most leading pages of `prompt` (the least loaded of equals),
        how many, and the prompt's page digests."""
        by_page_size: dict[int, list[bytes]] = {}
        best, matched = None, 0
        now = time.time()
        for view in sorted(views, key=lambda v: v.load):
            page_size = view.summary.page_size if view.summary else _page_size(views)
            if page_size <= 0:
                continue
            digests = by_page_size.get(page_size)
            if digests is None:
                digests = prompt_digests(prompt, page_size, tenant, lora)
                by_page_size[page_size] = digests
            held = view.summary.digests if view.summary else frozenset()
            n = 0
            for digest in digests:
                recent = self._recent.get((model, digest))
                if digest not in held and not (recent and recent[0] == view.name
                                               and recent[1] > now):
                    break
                n += 1
            if n > matched:
                best, matched = view, n
        first = next(iter(by_page_size.values()), [])
        return best, matched, first

    def _holds(self, model: str, view: WorkerView, lora: str) -> bool:
        """Whether `view`'s worker holds adapter `lora`, or was sent a request to load it a
        moment ago (its heartbeat may not say so yet)."""
        if lora in view.beat.loras:
            return True
        recent = self._recent_loras.get((model, lora))
        return recent is not None and recent[0] == view.name and recent[1] > time.time()

    @staticmethod
    def _placed(view: WorkerView) -> str:
        view.placed += 1
        return view.name


def _page_size(views: list[WorkerView]) -> int:
    """The page size of a worker whose summary is not read yet: its model's other workers'."""
    return next((v.summary.page_size for v in views if v.summary), 0)


def _beat(raw: bytes | None) -> Heartbeat | None:
    if raw is None:
        return None
    try:
        return Heartbeat.from_json(raw)
    except ValueError as e:
        log.warning("placement: %s", e)
        return None


def _summary(raw: bytes | None) -> PrefixSummary | None:
    if raw is None:
        return None
    try:
        return PrefixSummary.decode(raw)
    except ValueError as e:
        log.warning("placement: %s", e)
        return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
