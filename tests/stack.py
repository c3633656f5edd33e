"""Real processes for tests: API replicas and workers started as `redserve api|worker`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from ops.embedded_redis import free_port
from ops.testkit.probe import scrape, wait_healthy
from shared.keys import WORKER_GROUP, Keys, replica_of
from shared.messages import Error, Finish, GenerateRequest, Tokens, feed_fields
from shared.redis_address import is_sentinel_url, parse_sentinel_url
from shared.settings import WorkerSettings


def child_env(redis_url: str | None, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDSERVE_")}
    env.pop("REDIS_URL", None)
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    env["REDSERVE_KEY_PREFIX"] = prefix
    # Authentication is off unless a test gives keys (and then it is on: keys win).
    env["REDSERVE_NO_AUTH"] = "true"
    # The workers of the tests serve the tiny models unless they say otherwise (SmolLM2's pass
    # `real_kv()`): a pool of the default size would cost each worker start a second of CPU
    # zeroing a gigabyte, and the parallel test processes' stacks that gigabyte each.
    env["REDSERVE_KV_CACHE_MEMORY"] = str(TINY_KV_BYTES)
    env.update(extra)
    return env


class Deployment(Protocol):
    """Where a redserve deployment's keys live."""

    @property
    def redis_url(self) -> str: ...

    @property
    def prefix(self) -> str: ...


def inspect(at: Deployment, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`redserve inspect` run as a user runs it, on a pipe (so at its full width)."""
    environment = child_env(at.redis_url, at.prefix, **env)
    environment.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "ops.cli", "inspect", *args],
                          env=environment, capture_output=True, text=True, timeout=60)


def inspect_json(at: Deployment, *args: str, **env: str) -> dict[str, Any]:
    done = inspect(at, "--json", *args, **env)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@dataclass
class Stack:
    redis_url: str
    model: Path
    served_name: str | None = None
    workers: int = 1
    api: bool = True
    replicas: int = 1  # API replicas, on `port` and the ports in `more_ports`
    env: dict[str, str] = field(default_factory=dict)
    prefix: str = field(default_factory=lambda: f"rstest-{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    more_ports: list[int] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, *args: str) -> None:
        named = ["--served-model-name", self.served_name] if self.served_name else []
        defaults = {k: v for k, v in _kv_for(self.model).items() if k not in self.env}
        self.spawn(*args, "--model", str(self.model), *named, env=defaults)

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`redserve <args>` in this stack's environment (`env` added to it), its output in
        the stack's logs."""
        log = Path(tempfile.mkstemp(prefix="redserve-test-", suffix=".log")[1])
        self.logs.append(log)
        env = child_env(self.redis_url, self.prefix, **{**self.env, **(env or {})})
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ops.cli", *args], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{([self.port, *self.more_ports])[replica]}"

    @property
    def api_proc(self) -> subprocess.Popen[bytes]:
        assert self.api
        return self.procs[self.workers]

    def replica_proc(self, replica: int) -> subprocess.Popen[bytes]:
        return self.procs[self.workers + replica]

    def worker_proc(self, i: int = 0) -> subprocess.Popen[bytes]:
        return self.procs[i]

    def metrics(self, url: str) -> dict[str, float]:
        return scrape(url)

    def start(self, timeout: float = 120.0) -> Stack:
        for _ in range(self.workers):
            self._spawn("worker")
        if self.api:
            self.more_ports = [free_port() for _ in range(self.replicas - 1)]
            for port in [self.port, *self.more_ports]:
                self._spawn("api", "--host", "127.0.0.1", "--port", str(port))
            for i in range(self.replicas):
                self.wait_http(timeout, self.url(i))
        if self.workers:
            self.wait_workers(timeout)
        return self

    def wait_workers(self, timeout: float) -> None:
        """Until every worker has announced itself with a heartbeat."""
        # On a cluster, SCAN must visit every node.
        r = (RedisCluster.from_url(self.redis_url)
             if self.env.get("REDSERVE_REDIS_CLUSTER") == "true"
             else sync_client(self.redis_url))
        try:
            ok = eventually(
                lambda: len(list(r.scan_iter(match=f"{self.prefix}:worker:*"))) >= self.workers
                or any(p.poll() is not None for p in self.procs), timeout)
        finally:
            r.close()
        if not ok or any(p.poll() is not None for p in self.procs):
            raise RuntimeError(f"workers did not start:\n{self.output()}")

    def wait_http(self, timeout: float, url: str | None = None) -> None:
        if not wait_healthy(url or self.base_url,
                            lambda: all(p.poll() is None for p in self.procs), timeout):
            raise RuntimeError(f"the stack did not become healthy:\n{self.output()}")

    def output(self) -> str:
        return "\n".join(f"--- {log}\n{log.read_text()[-4000:]}" for log in self.logs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.unlink(missing_ok=True)


# The tiny test models' KV pool: 64 MiB holds 64k of their tokens, where the default (1 GiB, for
# real models) would take a gigabyte of memory per worker, and the parallel test processes'
# stacks would not fit in the machine's memory.
TINY_KV_BYTES = 64 * 1024**2


def real_kv() -> dict[str, str]:
    """The environment that gives a worker of a real model (SmolLM2) the default KV pool."""
    default = WorkerSettings.model_fields["kv_cache_memory"].default
    return {"REDSERVE_KV_CACHE_MEMORY": str(int(default))}


def _kv_for(model: Path) -> dict[str, str]:
    config = model / "config.json"
    tiny = config.is_file() and json.loads(config.read_text()).get("hidden_size", 1 << 30) <= 256
    return {"REDSERVE_KV_CACHE_MEMORY": str(TINY_KV_BYTES)} if tiny else real_kv()


def sync_client(url: str) -> redis.Redis:
    """A client of the Redis `url` names: a server, or the primary a redis+sentinel:// URL's
    Sentinels name."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url)
    address = parse_sentinel_url(url)
    return Sentinel(list(address.sentinels), socket_timeout=2.0).master_for(
        address.master, db=address.db, socket_timeout=2.0)


def queued_requests(r: redis.Redis, stream: str, n: int, timeout: float = 10.0
                    ) -> list[GenerateRequest]:
    """The first `n` requests on a model's request stream (the test playing the worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = r.xrange(stream)
        if len(entries) >= n:
            return [GenerateRequest.from_fields(fields) for _, fields in entries]
        time.sleep(0.02)
    raise TimeoutError(f"expected {n} queued requests")


def publish(r: redis.Redis, keys: Keys, request_id: str,
            *entries: Tokens | Finish | Error | dict[str, str]) -> None:
    """Write result entries as a worker does (the test playing the worker): each to the
    request's result stream, then to its replica's feed."""
    pipe = r.pipeline(transaction=False)
    for entry in entries:
        fields = entry if isinstance(entry, dict) else entry.to_fields()
        pipe.xadd(keys.out(request_id), fields)  # type: ignore[arg-type]
        pipe.xadd(keys.feed(replica_of(request_id)), feed_fields({request_id: fields}),  # type: ignore[arg-type]
                  nomkstream=True)
    pipe.execute()


def eventually(check: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def kill_first_worker_mid_stream(stack: Stack, r: redis.Redis, stream: str
                                       ) -> list[dict[str, Any]]:
    """SIGKILL the stack's first worker once it holds entries of `stream` (0.3 s later, so that
    it is mid-stream); the entries it held, pending in its name, before another takes them."""
    victim = f"{socket.gethostname()}-{stack.worker_proc(0).pid}"

    def held() -> list[dict[str, Any]]:
        return list(r.xpending_range(stream, WORKER_GROUP, "-", "+", 100, consumername=victim))

    assert await asyncio.to_thread(eventually, held, 30), "the first worker took nothing"
    await asyncio.sleep(0.3)
    stack.worker_proc(0).send_signal(signal.SIGKILL)
    stack.worker_proc(0).wait()
    return held()


@dataclass
class Up:
    """A running `redserve up`, its output gathered in a log file."""

    proc: subprocess.Popen[bytes]
    log: Path

    def said(self) -> str:
        return self.log.read_text()


@contextlib.contextmanager
def redserve_up(env: dict[str, str], port: int, model: Path, served_name: str,
                *more: str) -> Iterator[Up]:
    """`redserve up` started as a user starts it and waited on until it says it is ready; on
    leaving, stopped as a user stops it (SIGTERM), which must end it cleanly (exit 0)."""
    log = Path(tempfile.mkstemp(prefix="redserve-up-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--port", str(port),
                                 "--model", str(model), "--served-model-name", served_name,
                                 *more],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    up = Up(proc, log)
    try:
        assert eventually(lambda: "ready: http" in up.said() or proc.poll() is not None,
                          120), up.said()
        assert proc.poll() is None, up.said()
        yield up
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        said = up.said()
        log.unlink(missing_ok=True)
    assert code == 0, said
