"""The worker process: the step loop, its overlap with Redis, deadlines, drain and shutdown.

Each step overlaps Redis with compute: the model runs step N on a thread while the event loop
publishes step N-1 (one pipeline). New requests are read in the background as they arrive
(worker/broker/intake.py) and cancellations are heard the same way (worker/broker/aborts.py), so a
step costs no Redis command beyond its tokens; both are applied at the step boundary, where a
cancelled request's pages are freed. A request past its deadline is ended there too.

When Redis fails mid-step, nothing already decided is lost: the step's outputs are still staged,
and every terminal entry waits in the publisher's outbox; worker/broker/outage.py rides the
outage out or ends the requests held.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis

from shared import tracing
from shared.keys import Keys
from shared.messages import Error, FinishReason, GenerateRequest, Heartbeat, queue_timeout
from shared.models import ModelInfo
from shared.redis_conn import RedisClients, connect
from shared.retry import RedisBackoff
from shared.settings import WorkerSettings
from worker.broker.aborts import AbortWatch
from worker.broker.intake import Intake
from worker.broker.metrics import WorkerMetrics
from worker.broker.outage import Outage
from worker.broker.presence import Presence, Upkeep, Worker
from worker.broker.publisher import Publisher
from worker.broker.recovery import Claimed, Recovery, lost_tail, too_many_deliveries
from worker.broker.spans import RequestSpans
from worker.broker.take import Room, TakePolicy, Taker
from worker.engine.build import build_engine
from worker.engine.dev_hooks import DevHooks
from worker.engine.dtype import dtype_name
from worker.engine.engine import AdmissionError, Engine, StepOutput

log = logging.getLogger("redserve.worker")

TIMED_OUT = Error("request timed out", "timeout", "request_timeout")


class WorkerService:
    def __init__(self, settings: WorkerSettings, info: ModelInfo, engine: Engine,
                 clients: RedisClients, compute: Executor):
        self.settings = settings
        self.compute = compute  # the one thread every step runs on (see `serve`)
        self.info = info
        self.engine = engine
        self.scheduler = engine.scheduler  # the queue, the batch and the KV pool
        self.clients = clients
        self.name = settings.worker_name or f"{socket.gethostname()}-{os.getpid()}"
        # Each traced request's spans (worker/broker/spans.py); None when tracing is off.
        self.spans = RequestSpans.of(self.name)
        self.metrics = WorkerMetrics(engine, info.name, self.name, self.spans)
        keys = Keys(settings.key_prefix)
        self.publisher = Publisher(clients.commands, keys, info.name, settings, self.name,
                                   metrics=self.metrics)
        self.aborts = AbortWatch(keys)
        self.recovery = Recovery(clients.commands, keys, info.name, self.name,
                                 reclaim_after_s=2 * settings.heartbeat_ttl_s)
        self.taker = Taker(clients.commands, keys, info.name, self.name,
                           TakePolicy.of(settings))
        self.intake = Intake(clients, keys.requests(info.name), self.name, self.aborts,
                             self._take_room, settings.request_ttl_s, self.taker)
        self.presence = Presence(
            clients.commands, keys, settings.heartbeat_ttl_s,
            Worker(self.name, info.name, self._status, self._room, self.scheduler.request_ids,
                   self.scheduler.pages.summary),
            Upkeep(self.publisher, self.recovery, self.intake, self.aborts))
        self.stopping = asyncio.Event()
        self.outage = Outage(self.scheduler, self.publisher, self.intake, self.recovery,
                             self.stopping)
        self._failovers = 0  # the clients' count of failovers when last looked at
        self.fault_token_id = DevHooks().fault_token_id  # tests only (worker/engine/dev_hooks.py)

    def _room(self) -> int:
        return self.settings.max_running - self.scheduler.stats().requests

    def _take_room(self) -> Room:
        """What the intake may take now, beside what it holds already (see worker/broker/take.py:
        the burst is for tenants holding less than their share of the batch)."""
        tenants = collections.Counter(self.scheduler.tenants())
        tenants.update(c.request.tenant for c in self.intake.queue)
        held = tenants.total()
        return Room(self.settings.max_running - held,
                    min(self.taker.policy.burst, self.settings.batch_limit - held),
                    self.settings.max_running, dict(tenants))

    def _status(self) -> Heartbeat:
        """What this worker knows of itself; the beat adds its time, rate and draining."""
        stats, spec = self.scheduler.stats(), self.engine.speculator.stats()
        kernels, threads = self.engine.runner.kernels, self.engine.threads
        return Heartbeat(
            model=self.info.name,
            capacity=self.settings.max_running,
            running=stats.running,
            waiting=stats.waiting,
            kv_pages_used=stats.pages_used,
            kv_pages_free=stats.pages_free,
            kv_pages_cached=stats.pages_cached,
            kv_pages_total=stats.pages_total,
            generated_tokens=self.engine.num_generated,
            device=str(self.engine.runner.device),
            dtype=dtype_name(self.engine.runner.kv_shape.dtype),
            kernels=kernels.name,
            batch_invariant=kernels.batch_invariant,
            threads=threads.policy.most if threads else 0,
            decode_threads=threads.policy.decode if threads else 0,
            threads_last=threads.last if threads else 0,
            kv_dtype=self.engine.runner.kv_shape.storage_name,
            outbox=self.publisher.backlog,
            draft_tokens=spec.proposed, draft_tokens_accepted=spec.accepted,
            request_steps=spec.steps, request_step_tokens=spec.tokens,
            loras=self.engine.config.loras.resident if self.engine.config.loras else (),
        )

    async def run(self) -> None:
        await self._until_redis(self.intake.ensure_group)
        await self.intake.offer(await self._until_redis(self.recovery.own_pending) or [])
        tasks = [asyncio.create_task(self.presence.run()),
                 asyncio.create_task(self.aborts.listen(self.clients.blocking))]
        intake = asyncio.create_task(self.intake.run())
        log.info("ready: worker %s serving %s on %s in %s", self.name, self.info.name,
                 self.engine.runner.device, dtype_name(self.engine.runner.kv_shape.dtype))
        try:
            await self._serve()
            await self._drain(intake)
        finally:
            for task in [*tasks, intake]:
                task.cancel()
            await self._shutdown()

    async def _until_redis(self, action: Any) -> Any:
        backoff = RedisBackoff("Redis", start=0.2, cap=5.0, log=log)
        while not self.stopping.is_set():
            try:
                return await action()
            except aioredis.RedisError as e:
                await backoff.wait(e)

    async def _serve(self) -> None:
        while not self.stopping.is_set():
            if self.clients.failovers != self._failovers:  # what the old primary lost
                self._failovers = self.clients.failovers
                self.publisher.reassert_recent()
            self._admit(self.intake.take())
            try:
                if self.scheduler.has_work():
                    await self._step()
                else:
                    await self.publisher.flush(batch_now=True)
                    await _first(self.intake.arrived, self.stopping)
            except aioredis.RedisError as e:
                await self.outage.ride_out(e)

    async def _step(self) -> None:
        held = {rid: seq.request for rid, seq in self.scheduler.running.items()}
        held.update((seq.request.id, seq.request) for seq in self.scheduler.waiting)
        step = asyncio.ensure_future(
            asyncio.get_running_loop().run_in_executor(self.compute, self._compute))
        failure: aioredis.RedisError | None = None
        try:
            await self.publisher.flush()  # the last step's results, during this one
        except aioredis.RedisError as e:
            failure = e
        finally:
            outputs = await self._finish_step(step)
        self._served(held, outputs)
        self._end_aborted_and_late(outputs)
        self.intake.room_changed()
        if failure is not None:
            raise failure

    def _served(self, held: dict[str, GenerateRequest], outputs: list[StepOutput]) -> None:
        """Each tenant's tokens of the step, for its service counter (weighted, charged with
        the next take: worker/broker/take.py) and the metrics."""
        tokens: collections.Counter[tuple[str, float]] = collections.Counter()
        for out in outputs:
            request = held.get(out.request_id)
            if request is not None and out.error is None:
                tokens[request.tenant, request.weight] += 1
        for (tenant, weight), n in tokens.items():
            self.taker.tally.add(tenant, n / weight)
            self.metrics.served(tenant, "completion", n)

    def _compute(self) -> list[StepOutput]:
        fault = self.fault_token_id
        if fault is not None and any(fault in s.request.prompt_ids
                                     for s in self.scheduler.running.values()):
            raise RuntimeError(f"injected fault (prompt token {fault})")
        started = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.step_time.observe(time.perf_counter() - started)
        return outputs

    async def _finish_step(self, step: asyncio.Future[list[StepOutput]]) -> list[StepOutput]:
        try:
            outputs = await step
        except Exception as e:  # a failed forward must not take the worker down
            # Its new requests are known before they are ended below.
            self.metrics.admitted(self.scheduler.take_admissions())
            # The exception's text stays in the log: it may name internals.
            log.exception("step failed (%s); ending the requests in it", type(e).__name__)
            self.metrics.step_failures.inc()
            message = "the worker's model step failed; see the worker's log"
            for seq in self.scheduler.drop_running():
                self.publisher.stage_error(seq.request.id, Error(message))
            return []
        self.metrics.admitted(self.scheduler.take_admissions())
        self.metrics.steps.inc()
        return outputs

    def _end_aborted_and_late(self, outputs: list[StepOutput]) -> None:
        """Stage the step's outputs; a request found aborted ends with one abort entry
        instead, and one past its deadline with a timeout error."""
        now = time.time()
        ended: set[str] = set()
        for rid in self.aborts.aborted(self.scheduler.request_ids()):
            seq = self.scheduler.find(rid)
            if seq is not None and self.scheduler.abort(rid):
                ended.add(rid)
                self.publisher.stage([StepOutput(rid, seq.num_output, None, "abort",
                                                 seq.num_prompt, seq.num_output)])
        for rid in self.scheduler.request_ids():
            seq = self.scheduler.find(rid)
            if seq is not None and seq.request.deadline < now and self.scheduler.abort(rid):
                ended.add(rid)
                self.publisher.stage_error(rid, TIMED_OUT)
        self.publisher.stage([o for o in outputs if o.request_id not in ended])

    def _admit(self, intake: list[Claimed]) -> None:
        for claimed in intake:
            req, generated = claimed.request, claimed.generated
            self.publisher.take(req, claimed.entry_id, claimed.unrecorded)
            if claimed.deliveries == 1:  # charged to its tenant by the take
                self.metrics.served(req.tenant, "prompt", len(req.prompt_ids))
            if claimed.ended:  # its worker died between the terminal entry and the XACK
                self.publisher.stage_ack(req.id)
                continue
            # Its span here (traced requests only); every way on from here ends it.
            trace = None if self.spans is None else self.spans.taken(claimed)
            if claimed.aborted or self.aborts.aborted([req.id]):
                self._finish_unstarted(claimed, "abort")
                continue
            if len(generated) >= req.params.max_tokens:  # only its finish entry was lost
                self._finish_unstarted(claimed, "length")
                continue
            error, finish = self._refusal(claimed), None
            if error is None:
                try:
                    finish = self.engine.add(req, generated)
                except AdmissionError as e:
                    error = Error(str(e), "invalid_request_error", e.code)
            if error is not None:
                self.publisher.stage_error(req.id, error)
            elif finish is not None:  # its tokens complete its grammar: only the finish was lost
                self._finish_unstarted(claimed, finish)
            else:
                self.publisher.stage_running(req.id, trace)

    def _finish_unstarted(self, claimed: Claimed, finish: FinishReason) -> None:
        """End a request at admission, without a step: the tokens an earlier worker
        published stand as its completion."""
        done = len(claimed.generated)
        self.publisher.stage([StepOutput(claimed.request.id, done, None, finish,
                                         len(claimed.request.prompt_ids), done)])

    def _refusal(self, claimed: Claimed) -> Error | None:
        req, now = claimed.request, time.time()
        if now > req.deadline:
            return TIMED_OUT
        if claimed.deliveries > 1:  # taken over from a dead worker
            return (too_many_deliveries(claimed, self.settings.max_deliveries)
                    or lost_tail(claimed))
        if now > req.queue_deadline:
            return queue_timeout(req.model)
        if req.model != self.info.name:  # only a hand-made entry: streams are per model
            return Error(f"worker serves {self.info.name!r}, not {req.model!r}",
                         "invalid_request_error", "model_not_found")
        return None

    async def _drain(self, intake: asyncio.Task[None]) -> None:
        """Stop taking requests and hand back those not started, deterministically: the
        intake finishes its current read first, so every request this worker holds is
        either handed back here or finished (or ended) below."""
        self.presence.draining = True
        log.info("draining: worker %s takes no new requests, hands back those it has not "
                 "started and gives the %d running %.0f s to finish", self.name,
                 len(self.scheduler.running), self.settings.drain_grace_s)
        await self.presence.beat()  # no longer counted as a live worker
        self.intake.stop()
        with contextlib.suppress(Exception):
            await intake
        for claimed in self.intake.take():
            self.publisher.take(claimed.request, claimed.entry_id, claimed.unrecorded)
            self.publisher.stage_hand_back(claimed.request.id)
        for seq in self.scheduler.drop_waiting(unstarted_only=True):
            self.publisher.stage_hand_back(seq.request.id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_grace_s
        while self.scheduler.has_work() and loop.time() < deadline:
            try:
                await self._step()
            except aioredis.RedisError as e:
                await self.outage.ride_out(e)
        for claimed in self.intake.take():  # claimed from a dead worker as the drain began
            self.publisher.take(claimed.request, claimed.entry_id, claimed.unrecorded)
            self.publisher.stage_hand_back(claimed.request.id)
        with contextlib.suppress(aioredis.RedisError):
            await self.publisher.flush(batch_now=True)

    async def _shutdown(self) -> None:
        # Past the grace period: every request still here is handed back, to resume from its
        # published tokens on another worker (its tokens so far go out first, in this flush).
        left = [*self.scheduler.drop_running(), *self.scheduler.drop_waiting()]
        for seq in left:
            if seq.request.id in self.publisher.entry_ids:
                self.publisher.stage_hand_back(seq.request.id)
        try:
            await self.publisher.flush(batch_now=True)
        except aioredis.RedisError as e:
            log.warning("could not publish the last results (%d kept): %s",
                        self.publisher.backlog, e)
        await self.presence.leave()
        log.info("stopped: worker %s handed back %d request(s) still running, for another "
                 "worker to resume", self.name, len(left))


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def serve(settings: WorkerSettings, info: ModelInfo) -> None:
    # Every tensor operation of the worker runs on this one thread, from the engine's build
    # to each step. OpenMP keeps a team of threads for each thread that starts parallel work,
    # and once a process holds more of them than it has cores, libgomp stops spinning at its
    # barriers and sleeps at each one: a batch-1 decode step on 2 vCPUs took 42 ms where it
    # takes 23 ms with one team (docs/benchmarks.md, "Where one stream's time goes").
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redserve-compute")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(compute, build_engine, info, settings)
    assert settings.redis_url is not None
    tracing.configure("redserve-worker", settings.worker_name or "")
    clients = connect(settings.redis_url, name="redserve-worker", cluster=settings.redis_cluster)
    service = WorkerService(settings, info, engine, clients, compute)
    if settings.metrics_port:
        service.metrics.serve(settings.metrics_port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stopping.set)
    try:
        await service.run()
    finally:
        await clients.close()
        tracing.shutdown()  # the spans still buffered go out
        compute.shutdown(wait=False)  # its thread ends once idle
