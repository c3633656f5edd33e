"""The worker process: Redis intake, the step loop, heartbeats, drain and shutdown.

Each iteration overlaps Redis with compute: the model runs step N on a thread while the event
loop publishes step N-1 (one pipeline), takes in new requests, and reads every running request's
abort key (one more pipeline). The abort read waits until most of step N has passed: an abort
it sees is applied, and the request's KV freed, as soon as step N ends, so a cancellation takes
effect within about one step of the abort key being set, and the model never waits on Redis.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import orjson
import redis.asyncio as aioredis
import torch
from redis.exceptions import ResponseError

from shared.keys import WORKER_GROUP, Keys
from shared.messages import Error, GenerateRequest
from shared.models import ModelInfo
from shared.redis_conn import RedisClients, connect, stream_reply
from shared.settings import Settings
from worker import checkpoint
from worker.dtype import dtype_name, pick_dtype
from worker.engine import AdmissionError, Engine, EngineConfig, StepOutput
from worker.kv_cache import KVPool, budget_bytes
from worker.metrics import WorkerMetrics
from worker.model_runner import ModelRunner
from worker.publisher import Publisher
from worker.recovery import Claimed, Recovery, too_many_deliveries
from worker.synthetic import SyntheticRunner
from worker.threads import ThreadPolicy, usable_cpus

log = logging.getLogger("redserve.worker")

IDLE_BLOCK_MS = 1000
# The abort read is issued this far into a step (as a fraction of the recent step time).
ABORT_CHECK_AT = 0.8


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def build_engine(info: ModelInfo, settings: Settings) -> Engine:
    if settings.synthetic_step_ms:
        return _synthetic_engine(info, settings)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    log.info("computing in %s on %s (--dtype %s)", dtype_name(dtype), device, settings.dtype)
    large = settings.threads or usable_cpus()
    threads = ThreadPolicy(large, settings.decode_threads or large)
    if device.type == "cpu":
        log.info("CPU threads: %d in prefill steps, %d in decode steps", threads.large,
                 threads.small)
    runner = ModelRunner(checkpoint.load(info, device, dtype), release_modules=True)
    budget = budget_bytes(settings.kv_cache_memory, device)
    pool = KVPool.from_budget(runner.kv_shape, budget, settings.page_size)
    step_tokens = settings.max_prefill_tokens or (8192 if device.type == "cuda" else 512)
    config = EngineConfig(
        max_running=settings.max_running,
        max_step_tokens=step_tokens,
        max_model_len=info.max_model_len,
        page_size=settings.page_size,
        prefix_caching=settings.prefix_caching,
        threads=threads if device.type == "cpu" else None,
    )
    return Engine(runner, pool, config, eos_token_ids=info.eos_token_ids)


def _synthetic_engine(info: ModelInfo, settings: Settings) -> Engine:
    # Nothing to parallelise: more threads would only spin between steps and take CPU from
    # the processes being measured.
    torch.set_num_threads(1)
    vocab = int(orjson.loads((info.path / "config.json").read_bytes())["vocab_size"])
    runner = SyntheticRunner(vocab, settings.synthetic_step_ms / 1000)
    tokens = settings.max_running * info.max_model_len
    pool = KVPool(runner.kv_shape, -(-tokens // settings.page_size), settings.page_size)
    config = EngineConfig(max_running=settings.max_running, max_step_tokens=1 << 20,
                          max_model_len=info.max_model_len, page_size=settings.page_size,
                          prefix_caching=False)
    return Engine(runner, pool, config, eos_token_ids=info.eos_token_ids)


class WorkerService:
    def __init__(self, settings: Settings, info: ModelInfo, engine: Engine, clients: RedisClients):
        self.settings = settings
        self.info = info
        self.engine = engine
        self.clients = clients
        self.keys = Keys(settings.key_prefix)
        self.name = settings.worker_name or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = WorkerMetrics(engine)
        self.publisher = Publisher(
            clients.commands, self.keys, settings,
            on_end=lambda outcome: self.metrics.finished.labels(outcome).inc(),
        )
        self.recovery = Recovery(clients.commands, self.keys, self.name,
                                 reclaim_after_s=2 * settings.heartbeat_ttl_s)
        self._claimed: list[Claimed] = []  # taken over from dead workers, admitted next
        self.stopping = asyncio.Event()
        self._step_time = 0.0  # moving average of a step's wall time, in seconds

    async def run(self) -> None:
        await self._ensure_group()
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("worker %s serving %s on %s in %s", self.name, self.info.name,
                 self.engine.runner.device, dtype_name(self.engine.runner.kv_shape.dtype))
        try:
            await self._serve()
            await self._drain()
        finally:
            heartbeat.cancel()
            await self._shutdown()

    async def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                if not self.engine.has_work():
                    await self.publisher.flush()
                    self._admit(await self._read(block=True))
                    continue
                self._admit(await self._step(read=True))
            except aioredis.RedisError as e:
                await self._recover_redis(e)

    async def _recover_redis(self, error: aioredis.RedisError) -> None:
        """Redis went away mid-step. Results can't be published, and the replicas end their
        open streams, so end every request here; once Redis answers again (maybe restarted
        empty: the consumer group is made anew), publish their error entries so that none is
        left without a terminal entry, and serve on."""
        log.error("lost Redis (%s): ending %d request(s); reconnecting", error,
                  self.engine.num_requests)
        dropped = [s.request.id for s in [*self.engine.drop_running(),
                                           *self.engine.drop_waiting()]]
        self.publisher.discard_staged()
        lost = Error("the worker lost its connection to Redis", "server_error",
                     "redis_unavailable")
        backoff = 0.2
        while not self.stopping.is_set():
            await asyncio.sleep(backoff)
            try:
                await self._ensure_group()
                for request_id in dropped:
                    self.publisher.stage_error(request_id, lost)
                await self.publisher.flush()
            except aioredis.RedisError as e:
                self.publisher.discard_staged()
                backoff = min(backoff * 2, 5.0)
                log.warning("Redis still unavailable (%s); retrying in %.1fs", e, backoff)
                continue
            log.info("Redis is back; serving again")
            return

    async def _drain(self) -> None:
        """Stop taking requests; hand back those not started; let running ones finish."""
        await self._beat()  # no longer counted as a live worker
        for seq in self.engine.drop_waiting(unstarted_only=True):
            self.publisher.stage_hand_back(seq.request)
            self.metrics.handed_back.inc()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_grace_s
        while self.engine.has_work() and loop.time() < deadline:
            await self._step(read=False)
        await self.publisher.flush()

    async def _step(self, *, read: bool) -> list[tuple[Claimed, bool]]:
        loop = asyncio.get_running_loop()
        watched = self.engine.request_ids()
        started = loop.time()
        step = asyncio.create_task(asyncio.to_thread(self._compute))
        new: list[tuple[Claimed, bool]] = []
        try:
            # While the model computes: publish the last step, take in new requests, then,
            # late in the step, read the abort keys. None of it makes the model wait.
            await self.publisher.flush()
            if read:
                new = await self._read(block=False)
            late = started + ABORT_CHECK_AT * self._step_time - loop.time()
            if late > 0:
                await asyncio.wait([step], timeout=late)
            aborted = await self.publisher.aborted(watched)
        finally:
            outputs = await self._finish_step(step)
        elapsed = loop.time() - started
        self._step_time = elapsed if not self._step_time else 0.8 * self._step_time + 0.2 * elapsed
        self._apply_aborts(aborted, outputs)
        return new

    def _compute(self) -> list[StepOutput]:
        fault = self.settings.fault_token_id
        if fault is not None and any(fault in s.request.prompt_ids
                                     for s in self.engine.running.values()):
            raise RuntimeError(f"injected fault (prompt token {fault})")
        return self.engine.step()

    async def _finish_step(self, step: asyncio.Task[list[StepOutput]]) -> list[StepOutput]:
        try:
            outputs = await step
        except Exception as e:  # a failed forward must not take the worker down
            # The exception's text stays in the log: it may name internals.
            log.exception("step failed (%s); ending the requests in it", type(e).__name__)
            self.metrics.step_failures.inc()
            message = "the worker's model step failed; see the worker's log"
            for seq in self.engine.drop_running():
                self.publisher.stage_error(seq.request.id, Error(message))
            return []
        self.metrics.steps.inc()
        return outputs

    def _apply_aborts(self, aborted: set[str], outputs: list[StepOutput]) -> None:
        """Stage the step's outputs, replacing those of aborted requests by one abort entry."""
        dropped: set[str] = set()
        for rid in aborted:
            seq = self.engine.find(rid)
            if seq is None:
                continue  # it finished in this very step: its own outputs stand
            self.engine.abort(rid)
            dropped.add(rid)
            self.publisher.stage([StepOutput(rid, seq.num_output, None, "abort",
                                             seq.num_prompt, seq.num_output)])
        self.publisher.stage([o for o in outputs if o.request_id not in dropped])

    async def _read(self, *, block: bool) -> list[tuple[Claimed, bool]]:
        """Requests to admit: those claimed from dead workers, then new ones from the stream;
        each with whether its abort key is already set."""
        claimed, self._claimed = self._claimed, []
        room = self.settings.max_running - self.engine.num_requests - len(claimed)
        if room > 0:
            response = await self.clients.blocking.xreadgroup(
                WORKER_GROUP, self.name, {self.keys.requests: ">"}, count=room,
                block=IDLE_BLOCK_MS if block and not claimed else None,
            )
            replies = stream_reply(response)
            for entry_id, fields in replies[0][1] if replies else []:
                eid = entry_id.decode()
                try:
                    claimed.append(Claimed(eid, GenerateRequest.from_fields(fields), (), False, 1))
                except (KeyError, ValueError):
                    # The API validates everything it enqueues; a foreign entry has nowhere
                    # to send an error, so drop it.
                    log.error("dropping malformed request entry %s", eid)
                    await self.clients.commands.xack(self.keys.requests, WORKER_GROUP, eid)
        if not claimed:
            return []
        pipe = self.clients.commands.pipeline(transaction=False)
        for c in claimed:
            pipe.exists(self.keys.abort(c.request.id))
        flags = await pipe.execute()
        return [(c, bool(f)) for c, f in zip(claimed, flags, strict=True)]

    def _admit(self, intake: list[tuple[Claimed, bool]]) -> None:
        for claimed, aborted in intake:
            req, generated = claimed.request, claimed.generated
            self.publisher.take(req, claimed.entry_id)
            if claimed.ended:  # its worker died between the terminal entry and the XACK
                self.publisher.stage_ack(req.id)
                continue
            if aborted:  # cancelled while queued (or while its worker was dying)
                self.publisher.stage([StepOutput(req.id, len(generated), None, "abort",
                                                 len(req.prompt_ids), len(generated))])
                continue
            if len(generated) >= req.params.max_tokens:  # only its finish entry was lost
                self.publisher.stage([StepOutput(req.id, len(generated), None, "length",
                                                 len(req.prompt_ids), len(generated))])
                continue
            error = self._refusal(claimed)
            if error is None:
                try:
                    self.engine.add(req, generated)
                except AdmissionError as e:
                    error = Error(str(e), "invalid_request_error", "context_length")
            if error is not None:
                self.publisher.stage_error(req.id, error)
            else:
                self.publisher.stage_running(req.id, self.name)

    def _refusal(self, claimed: Claimed) -> Error | None:
        req, now = claimed.request, time.time()
        if claimed.deliveries > 1:  # taken over from a dead worker
            if now > req.deadline:
                return Error("request timed out", "timeout", "request_timeout")
            return too_many_deliveries(claimed, self.settings.max_deliveries)
        if now > req.queue_deadline:
            return Error("no worker took the request before its queue deadline",
                         "server_error", "queue_timeout")
        if req.model != self.info.name:
            return Error(f"worker serves {self.info.name!r}, not {req.model!r}",
                         "invalid_request_error", "model_not_found")
        return None

    async def _ensure_group(self) -> None:
        try:
            # From id 0: requests enqueued before any worker existed are still served.
            await self.clients.commands.xgroup_create(
                self.keys.requests, WORKER_GROUP, id="0", mkstream=True
            )
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def _heartbeat(self) -> None:
        while True:
            await self._beat()
            try:
                await self.recovery.touch(self.publisher.entry_ids.values())
                if not self.stopping.is_set():
                    room = (self.settings.max_running - self.engine.num_requests
                            - len(self._claimed))
                    self._claimed += await self.recovery.claim(room)
            except aioredis.RedisError as e:
                log.warning("could not refresh or claim pending requests: %s", e)
            await asyncio.sleep(self.settings.heartbeat_ttl_s / 3)

    async def _beat(self) -> None:
        """Announce this worker: its status key, and its place among the model's live workers
        (which API replicas read for /ready) unless it is draining."""
        ttl = self.settings.heartbeat_ttl_s
        draining = self.stopping.is_set()
        body = {
            "model": self.info.name,
            "capacity": self.settings.max_running,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "kv_pages_free": self.engine.pages.available,
            "kv_pages_total": self.engine.pages.num_pages,
            "device": str(self.engine.runner.device),
            "dtype": dtype_name(self.engine.runner.kv_shape.dtype),
            "draining": draining,
        }
        workers = self.keys.workers(self.info.name)
        pipe = self.clients.commands.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.name), orjson.dumps(body), ex=ttl)
        if draining:
            pipe.zrem(workers, self.name)
        else:
            pipe.zadd(workers, {self.name: time.time() + ttl})
            pipe.expire(workers, ttl * 3)
        try:
            await pipe.execute()
        except aioredis.RedisError as e:
            log.warning("heartbeat failed: %s", e)

    async def _shutdown(self) -> None:
        # Past the grace period: every request still here ends with a terminal entry.
        shutdown = Error("worker shut down before the request finished", "server_error",
                         "worker_shutdown")
        for seq in [*self.engine.drop_running(), *self.engine.drop_waiting()]:
            self.publisher.stage_error(seq.request.id, shutdown)
        try:
            await self.publisher.flush()
            await self.clients.commands.delete(self.keys.worker(self.name))
            await self.clients.commands.zrem(self.keys.workers(self.info.name), self.name)
        except aioredis.RedisError as e:
            log.warning("could not publish shutdown: %s", e)


async def serve(settings: Settings, info: ModelInfo) -> None:
    engine = await asyncio.to_thread(build_engine, info, settings)
    assert settings.redis_url is not None
    clients = connect(settings.redis_url, name="redserve-worker", cluster=settings.redis_cluster)
    service = WorkerService(settings, info, engine, clients)
    if settings.metrics_port:
        service.metrics.serve(settings.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stopping.set)
    try:
        await service.run()
    finally:
        await clients.close()
