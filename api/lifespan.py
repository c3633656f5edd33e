"""A replica's start-up and shut-down, as FastAPI's lifespan runs them.

Start-up loads the served models' tokenizers, wires the parts every route uses into one
`AppContext` on one Redis connection, then starts what runs beside the requests: the result
reader (which waits for Redis if it does not answer yet: api/queue/reader.py), then, once Redis
answers, the placement refresher, the watch of the workers' liveness and the refresh of the
runtime LoRA adapters' registry. Shut-down ends the
requests still open past the drain (`api.app.drain`), then stops reading and disconnects;
streams waiting out their resume grace run on, only their pending cancellation goes. What does
not depend on Redis or a model (the API keys, the tenants' policies, the metrics) is made
before, by `api.app.create_app`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI

from api.protocol.served_model import ServedModel
from api.protocol.text import TextCodec
from api.queue.admission import Admission, QueueLimits, Replication
from api.queue.context import AppContext, Live
from api.queue.limits.reservation import RateLimits
from api.queue.loras import LoraRegistry
from api.queue.metrics import APIMetrics, QueueDepths
from api.queue.placement import Placement
from api.queue.reader import ResultReader
from api.queue.worker_watch import WorkerWatch
from shared.keys import Keys, new_replica_tag
from shared.lora import parse_lora_specs, read_adapters
from shared.messages import Error
from shared.models import parse_specs, resolve_models
from shared.redis_conn import RedisClients, connect
from shared.settings import ApiSettings
from shared.tenants import TenantPolicies

# How long a shutdown waits for background responses to store their ends (one write each).
BACKGROUND_WAIT_S = 2.0


@dataclass(frozen=True)
class Lifespan:
    """FastAPI's `lifespan`: the replica's context is `app.state.ctx` while it serves."""

    settings: ApiSettings
    redis_url: str
    policies: TenantPolicies
    metrics: APIMetrics

    @asynccontextmanager
    async def __call__(self, app: FastAPI) -> AsyncIterator[None]:
        ctx = await self.start_up()
        beside = asyncio.create_task(run_beside(ctx))
        app.state.ctx = ctx
        try:
            yield
        finally:
            beside.cancel()
            await shut_down(ctx)

    async def start_up(self) -> AppContext:
        """The models and their LoRA adapters loaded, the parts wired and watched, the result
        reader started."""
        models = await load_models(self.settings)
        ctx = self.wire(models, await asyncio.to_thread(load_adapters, self.settings, models))
        watch(ctx)
        await ctx.reader.start(self.settings.request_ttl_s)
        return ctx

    def wire(self, models: dict[str, ServedModel],
             adapters: dict[str, ServedModel]) -> AppContext:
        """The replica's parts, on one new Redis connection; nothing started yet."""
        settings, metrics = self.settings, self.metrics
        replica = new_replica_tag()
        keys = Keys(settings.key_prefix)
        clients = connect(self.redis_url, name=f"redserve-api-{replica}",
                          cluster=settings.redis_cluster)
        live = Live()
        reader = ResultReader(clients, keys, replica, settings.per_request_buffer,
                              settings.slow_client_timeout_s,
                              on_slow_client(live, metrics, settings))
        placement = Placement(clients.commands, keys, list(models), settings.placement,
                              metrics, remember_s=settings.heartbeat_ttl_s)
        workers = WorkerWatch(clients.commands, keys, list(models), settings.heartbeat_ttl_s,
                              starting_s=settings.queue_timeout_s)
        loras = LoraRegistry(clients.commands, keys, models, adapters, metrics)
        return AppContext(settings, keys, models, clients, reader,
                          queue_admission(clients, keys, settings), metrics, replica, self.policies,
                          RateLimits(clients.commands, keys), placement, workers, loras, live,
                          adapters)


async def run_beside(ctx: AppContext) -> None:
    """What runs beside the requests, once Redis answered (until then only the reader says
    so): the placement's view of the workers, the watch of their liveness, and the view of
    the LoRA adapters loaded at run time."""
    await ctx.reader.until_connected()
    await asyncio.gather(ctx.placement.run(), ctx.workers.run(), ctx.loras.run())


async def load_models(settings: ApiSettings) -> dict[str, ServedModel]:
    """Each served model's checkpoint facts and tokenizer, by the name clients use, loaded
    off the event loop."""
    specs = parse_specs(settings.model, settings.served_model_name, settings.models_file)
    infos = await asyncio.to_thread(resolve_models, specs, settings.cache_dir)
    return {info.name: ServedModel(info, await asyncio.to_thread(TextCodec, str(info.path)))
            for info in infos}


def load_adapters(settings: ApiSettings,
                  models: dict[str, ServedModel]) -> dict[str, ServedModel]:
    """The declared LoRA adapters, each served over its base model with the base's tokenizer
    (checked as a worker checks them: `shared/lora.py`)."""
    adapters = read_adapters(parse_lora_specs(settings.lora),
                             {name: m.info.path for name, m in models.items()},
                             settings.max_lora_rank)
    return {name: replace(models[base], lora=adapter)
            for name, (base, adapter) in adapters.items()}


def queue_admission(clients: RedisClients, keys: Keys, settings: ApiSettings) -> Admission:
    """The queue's admission, bounded as the settings say."""
    limits = QueueLimits(settings.max_queued_requests, settings.max_queued_tokens,
                         settings.queue_timeout_s, settings.max_queued_per_tenant)
    return Admission(clients.commands, keys, limits, settings.request_ttl_s,
                     Replication(settings.admission_wait_replicas, settings.admission_wait_ms))


def on_slow_client(live: Live, metrics: APIMetrics, settings: ApiSettings
                   ) -> Callable[[str], None]:
    """What the result reader calls for a request whose client reads too slowly: it ends
    with `client_too_slow`."""
    error = Error(f"the client read too slowly: its {settings.per_request_buffer} buffered "
                  f"results waited over {settings.slow_client_timeout_s:g}s",
                  "server_error", "client_too_slow")

    def slow(request_id: str) -> None:
        generation = live.requests.get(request_id)
        if generation is not None:
            metrics.slow_clients.inc()
            generation.fail(error)

    return slow


def watch(ctx: AppContext) -> None:
    """The gauges read at each scrape: requests in flight, result subscriptions and what
    they buffer, and each model's queue depth."""
    reader, keys = ctx.reader, ctx.keys
    ctx.metrics.watch(
        inflight=lambda: len(ctx.live.requests) + len(ctx.live.resumes),
        queues=lambda: len(reader.subscriptions),
        buffered=lambda: sum(s.queue.qsize() for s in reader.subscriptions.values()),
    )
    ctx.metrics.watch_queues(QueueDepths(ctx.clients.commands,
                                         {name: keys.queued(name) for name in ctx.models},
                                         ctx.settings.queue_timeout_s))


async def shut_down(ctx: AppContext) -> None:
    """Requests still open here are past the drain: end their part here (`Live.stop_all`),
    then stop reading. Disconnected streams still in their resume grace run on to their end
    (another replica may be serving their resume); only the pending cancellation goes."""
    ctx.live.stop_all()
    for deferred in list(ctx.live.deferred):
        deferred.cancel()
    if ctx.live.background:  # their requests just failed: each stores its end, then stops
        _, late = await asyncio.wait(ctx.live.background, timeout=BACKGROUND_WAIT_S)
        for task in late:
            task.cancel()
    await ctx.reader.stop()
    await ctx.clients.close()
