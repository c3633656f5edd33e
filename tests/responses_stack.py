"""What the Responses API tests share: two API replicas, a worker and Redis, with the
environment (tenants' keys, TTLs) each test file sets, and the official client on either
replica."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from tests.stack import Stack

MODEL = "tiny-llama"


@contextmanager
def two_replicas(redis_url: str, tiny_model: Path, env: dict[str, str]) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name=MODEL, replicas=2, env=env).start()
    try:
        yield stack
    finally:
        stack.stop()


def client(stack: Stack, replica: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url(replica)}/v1", api_key=key, max_retries=0,
                         timeout=60)
