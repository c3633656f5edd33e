"""Looking at a running replica from outside: wait for /health, read /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def wait_healthy(base_url: str, alive: Callable[[], bool], timeout: float) -> bool:
    """Poll `base_url`/health until it answers 200 (True), `alive()` turns false or `timeout`
    passes (False)."""
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def scrape(url: str) -> dict[str, float]:
    """Prometheus text exposition at `url` as {sample name with labels: value}."""
    samples = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
