"""LoRA adapters loaded on demand through the real system: a replica started with two adapters
(`REDSERVE_LORA`) and a worker started with none and `--max-loras 1`. The worker loads each
adapter from the path its request carries, its text that of peft's merged model; the second
evicts the first; its heartbeat (`redserve inspect`) lists what it holds, and its metrics count
each adapter's loads and evictions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedModel

from ops.embedded_redis import free_port
from tests.lora_adapters import ALL, greedy, make_adapter, merged
from tests.stack import Stack, eventually, inspect_json

BASE = "tiny-llama"
PROMPT = [50, 7, 300, 9, 1000, 11, 12, 13]
NEW = 12


@pytest.fixture(scope="module")
def adapters(tiny_base_model: PreTrainedModel,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demand-loras")
    return {"alpha": make_adapter(tiny_base_model, root / "alpha", ALL, seed=1),
            "beta": make_adapter(tiny_base_model, root / "beta", ["q_proj", "down_proj"],
                                 seed=2)}


@pytest.fixture(scope="module")
def stacks(redis_url: str, tiny_model: Path,
           adapters: dict[str, Path]) -> Iterator[tuple[Stack, Stack, int]]:
    lora = ",".join(f"{name}={path}" for name, path in adapters.items())
    api = Stack(redis_url, tiny_model, served_name=BASE, workers=0,
                env={"REDSERVE_DTYPE": "float32", "REDSERVE_LORA": lora}).start()
    port = free_port()
    worker = Stack(redis_url, tiny_model, served_name=BASE, api=False, prefix=api.prefix,
                   env={"REDSERVE_DTYPE": "float32", "REDSERVE_MAX_LORAS": "1",
                        "REDSERVE_METRICS_PORT": str(port)})
    try:
        worker.start()
        yield api, worker, port
    finally:
        worker.stop()
        api.stop()


def test_a_worker_without_lora_loads_each_adapter_its_requests_name(
        stacks: tuple[Stack, Stack, int], tiny_model: Path, tiny_base_model: PreTrainedModel,
        adapters: dict[str, Path]) -> None:
    api, worker, port = stacks
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="x", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    for name in ["alpha", "beta", "alpha"]:
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
        expected = greedy(merged(tiny_base_model, adapters[name]), PROMPT, NEW)
        assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        # --max-loras 1: the other was evicted (as the next heartbeat says)
        assert eventually(lambda n=name: [w["loras"] for w in inspect_json(api)["workers"]]
                          == [[n]], 30)
    metrics = worker.metrics(f"http://127.0.0.1:{port}/metrics")
    assert metrics['redserve_worker_lora_loads_total{adapter="alpha"}'] == 2
    assert metrics['redserve_worker_lora_loads_total{adapter="beta"}'] == 1
    assert metrics['redserve_worker_lora_evictions_total{adapter="alpha"}'] == 1
    assert metrics["redserve_worker_lora_resident"] == 1
