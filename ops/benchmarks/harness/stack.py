"""The one way a benchmark starts what it measures: processes of the `redserve` command, as an
operator runs them, never an app built in process (what is measured is the deployment).

- `up`: `redserve up` (embedded Redis unless REDIS_URL, one replica, one worker), as a
  `Server`; `Server` also runs a peer (`transformers serve`, vLLM) the same way.
- `Processes`: `redserve api` and `redserve worker` processes on one Redis under a key prefix of
  their own, each started, restarted or stopped on its own, for benchmarks that vary the
  topology (workers, replicas, a queue policy, placement).
- `redis_url`: the Redis they share, REDIS_URL if set, else an embedded Valkey.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import redis

from ops.benchmarks.machine import cpu_seconds, descendants, peak_rss_mib
from ops.embedded_redis import EmbeddedRedis, free_port
from ops.testkit.probe import wait_healthy
from shared.settings import DEFAULT_MODEL

REDSERVE = [sys.executable, "-m", "ops.cli"]
# Replicas on loopback that serve the benchmark's own clients only: no API key asked.
NO_AUTH = {"REDSERVE_NO_AUTH": "true", "REDSERVE_API_KEYS": ""}
# A queue no load of a benchmark fills: what is measured is serving, not refusals.
UNBOUNDED_QUEUE = {"REDSERVE_MAX_QUEUED_REQUESTS": "100000"}


class Server:
    """A server started in its own session, stopped with everything it started."""

    def __init__(self, cmd: list[str], port: int, model: str,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.port, self.model = port, model
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, **(env or {})},
                                     cwd=cwd)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600) -> float:
        """Until a chat request is answered; the seconds from the start."""
        deadline = time.monotonic() + timeout
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                reply = httpx.post(f"{self.base}/v1/chat/completions", json=body, timeout=60)
                if reply.status_code == 200:
                    return time.perf_counter() - self.started
            time.sleep(0.1)
        raise TimeoutError("server did not answer")

    def child(self, role: str) -> int:
        """The pid of the process `redserve up` started for `role` ("api", "worker")."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return next(int(c) for c in children.split()
                    if f"\x00{role}\x00".encode() in Path(f"/proc/{c}/cmdline").read_bytes())

    def rss(self) -> float:
        return peak_rss_mib(descendants(self.proc.pid))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def up(*options: str, env: dict[str, str] | None = None, model: str = DEFAULT_MODEL,
       tree: str | None = None) -> Server:
    """`redserve up` on a free port with `options`; `env` overrides settings (`REDSERVE_*`,
    REDIS_URL); `model` is the served name to wait on; `tree`: the code of another checkout
    (an earlier commit's `git worktree`), run on this environment, for a before-and-after."""
    port = free_port()
    env = {**(env or {}), **({"PYTHONPATH": tree} if tree else {})}
    return Server([*REDSERVE, "up", "--port", str(port), *options], port, model, env, cwd=tree)


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """REDIS_URL when set (a server of the caller's), else a fresh embedded Valkey's."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = EmbeddedRedis()
    try:
        yield server.start()
    finally:
        server.stop()


class Processes:
    """`redserve api` and `redserve worker` processes on `redis_url` under a key prefix of
    their own, serving `model` as `served`, each logging to a file in `logs` (kept when a
    start fails, removed by a clean `stop`)."""

    def __init__(self, redis_url: str, model: Path | str, served: str = DEFAULT_MODEL,
                 env: dict[str, str] | None = None, name: str = "bench") -> None:
        self.prefix = f"{name}-{uuid.uuid4().hex[:6]}"
        self.env = {**os.environ, "REDIS_URL": redis_url, "REDSERVE_KEY_PREFIX": self.prefix,
                    **(env or {})}
        self.model = ["--model", str(model), "--served-model-name", served]
        self.logs = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []
        self.failed = False

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None) -> None:
        self.stop_one(name)
        log = open(self.logs / f"{name}.log", "ab")  # closed in stop()
        self._files.append(log)
        self.procs[name] = subprocess.Popen([*REDSERVE, *args, *self.model],
                                            env={**self.env, **(env or {})}, stdout=log,
                                            stderr=subprocess.STDOUT)

    def api(self, *options: str, name: str = "api", env: dict[str, str] | None = None) -> str:
        """A replica on a free port; its base URL."""
        port = free_port()
        self._spawn(name, ["api", "--host", "127.0.0.1", "--port", str(port), *options], env)
        return f"http://127.0.0.1:{port}"

    def worker(self, *options: str, name: str = "worker",
               env: dict[str, str] | None = None) -> None:
        self._spawn(name, ["worker", *options], env)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def wait_ready(self, url: str, workers: int = 1, timeout: float = 300) -> None:
        """Until the replica at `url` answers and sees `workers` live workers."""
        deadline = time.monotonic() + timeout
        if not wait_healthy(url, self.alive, timeout):
            raise RuntimeError(self._failure(f"no /health 200 from {url}"))
        while time.monotonic() < deadline and self.alive():
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{url}/ready", timeout=2)
                if ready.status_code == 200 and ready.json().get("workers", 0) >= workers:
                    return
            time.sleep(0.2)
        raise RuntimeError(self._failure(f"{url} saw fewer than {workers} workers"))

    def cpu_seconds(self, name: str) -> float:
        """User and system CPU the process has used so far."""
        return cpu_seconds(self.procs[name].pid)

    def _failure(self, what: str) -> str:
        self.failed = True
        tails = [f"--- {p.name} (last lines) ---\n"
                 + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                 for p in sorted(self.logs.glob("*.log"))]
        return f"the stack did not start ({what}); logs in {self.logs}\n" + "\n".join(tails)

    def stop_one(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for name in list(self.procs):
            self.stop_one(name)
        for f in self._files:
            f.close()
        if not self.failed:
            shutil.rmtree(self.logs, ignore_errors=True)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def self_cpu_seconds() -> float:
    """User and system CPU this process (the load generator) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def redis_cpu(r: redis.Redis) -> float:
    """The CPU seconds (user and system) the Redis server has used so far."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
