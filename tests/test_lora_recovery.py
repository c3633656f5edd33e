"""A worker killed with SIGKILL mid-stream on a LoRA adapter: the other worker takes its requests
over (worker/broker/recovery.py re-reads each request's entry, adapter included) and every
stream, streamed to the official `openai` client, ends with exactly the text of an undisturbed
run, its adapter's and not the base's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from transformers import PreTrainedModel

from shared.keys import Keys
from shared.messages import GenerateRequest
from tests.lora_adapters import ALL, make_adapter
from tests.stack import Stack, kill_first_worker_mid_stream

BASE = "tiny-llama"
# Each stream's model: mostly adapters, a few base rows beside them.
MODELS = ["alpha", "beta", "alpha", BASE] * 3
NEW = 200


def _prompt(i: int) -> list[int]:
    return [50 + i, 7, 300 + 11 * i, 9, 1000 + i]


async def _stream(client: openai.AsyncOpenAI, i: int, model: str) -> tuple[str, str]:
    """The streamed text and finish reason."""
    stream = await client.completions.create(model=model, prompt=_prompt(i), max_tokens=NEW,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    parts, finish = [], ""
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


async def _all(url: str, models: list[str]) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    return await asyncio.gather(*(_stream(client, i, m) for i, m in enumerate(models)))


@pytest.fixture(scope="module")
def adapters(tiny_base_model: PreTrainedModel,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_base_model  # the session's (make_adapter copies it)
    root = tmp_path_factory.mktemp("recovery-loras")
    return {"alpha": make_adapter(base, root / "alpha", ALL, seed=3),
            "beta": make_adapter(base, root / "beta", ["k_proj", "up_proj"], seed=4)}


def test_a_killed_workers_adapter_streams_continue_on_another_with_their_adapter(
        redis_url: str, sync_redis: redis.Redis, tiny_model: Path,
        adapters: dict[str, Path]) -> None:
    lora = ",".join(f"{name}={path}" for name, path in adapters.items())
    stack = Stack(redis_url, tiny_model, served_name=BASE, workers=2, env={
        "REDSERVE_LORA": lora, "REDSERVE_DTYPE": "float32", "REDSERVE_KERNELS": "torch",
        "REDSERVE_HEARTBEAT_TTL_S": "2"}).start()
    keys = Keys(stack.prefix)
    try:
        undisturbed = asyncio.run(_all(stack.base_url, MODELS))
        assert all(finish == "length" for _, finish in undisturbed)
        base_texts = asyncio.run(_all(stack.base_url, [BASE] * len(MODELS)))
        for (text, _), (base_text, _), model in zip(undisturbed, base_texts, MODELS,
                                                    strict=True):
            assert (text == base_text) == (model == BASE), model

        orphans: list[dict[str, Any]] = []
        orphaned: set[str] = set()  # the adapters of the killed worker's requests

        async def disturbed() -> list[tuple[str, str]]:
            run = asyncio.create_task(_all(stack.base_url, MODELS))
            orphans.extend(await kill_first_worker_mid_stream(stack, sync_redis,
                                                              keys.requests(BASE)))
            for orphan in orphans:  # read before the survivor takes them over and ends them
                entry = sync_redis.xrange(keys.requests(BASE), orphan["message_id"],
                                          orphan["message_id"])
                orphaned.add(GenerateRequest.from_fields(entry[0][1]).lora)
            return await run

        results = asyncio.run(disturbed())
        assert orphaned & {"alpha", "beta"}, f"no adapter request was recovered: {orphaned}"
        assert results == undisturbed, stack.output()
    finally:
        stack.stop()
