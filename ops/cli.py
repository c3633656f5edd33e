"""`redserve`: run the whole system (`up`), or one API replica or one worker as pods do."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys

from ops.inspector.inspect_command import add_arguments as add_inspect_arguments
from ops.loadtest.bench_command import add_arguments as add_bench_arguments
from ops.options import (
    LIMITS,
    LOGGING,
    LORA,
    api_options,
    logging_options,
    lora_options,
    lora_specs,
    model_options,
    model_specs,
    positive,
    settings_from,
    worker_options,
)
from shared.logs import setup_logging
from shared.lora import LoraError, read_adapters
from shared.models import (
    ModelNotFound,
    converts_default,
    parse_specs,
    resolve_model,
    resolve_models,
)
from shared.settings import ApiSettings, Settings, WorkerSettings

log = logging.getLogger("redserve.cli")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="redserve",
        description="OpenAI-compatible LLM serving over Redis Streams. Redis is REDIS_URL "
        "(or REDSERVE_REDIS_URL); every other setting also reads REDSERVE_<NAME>.",
    )
    sub = top.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything locally: Redis (embedded unless REDIS_URL "
                        "is set), API replicas and workers for each model, restarted when "
                        "they exit; Ctrl-C stops it all",
                        description="Run the whole system in one process tree: a child that "
                        "exits is restarted (with backoff); Ctrl-C or SIGTERM stops it all.")
    api_options(up, "127.0.0.1", "the default when no key is set and the host is a "
                 "loopback address; anywhere else keys are required unless this is given")
    model_options(up, several=True)
    lora_options(up)
    worker_options(up)
    up.add_argument("--replicas", type=positive, default=1, help="API replicas, on consecutive "
                    "ports from --port (default 1)")
    up.add_argument("--workers", type=positive, default=1, help="workers per model "
                    "(default 1)")
    logging_options(up, access_log=True)

    api = sub.add_parser("api", help="run one API replica against REDIS_URL",
                         description="Run one stateless API replica against REDIS_URL.")
    api_options(api, "0.0.0.0", "without it, a replica with no key configured refuses "
                 "to start")
    model_options(api, several=True)
    lora_options(api)
    logging_options(api, access_log=True)

    worker = sub.add_parser("worker", help="run one worker against REDIS_URL",
                            description="Run one worker (model + batching) against REDIS_URL.")
    model_options(worker, several=False)
    lora_options(worker)
    worker_options(worker)
    worker.add_argument("--name", dest="worker_name", help="consumer name in the group "
                        "(default host-pid) [env REDSERVE_WORKER_NAME]")
    worker.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this "
                        "port (default off) [env REDSERVE_METRICS_PORT]")
    logging_options(worker, access_log=False)

    inspect = sub.add_parser("inspect", help="show the deployment from Redis: requests in "
                             "flight, queues, workers (read-only)",
                             description="A read-only view of the whole deployment, read "
                             "from REDIS_URL: every request in flight, each model's queue "
                             "and consumer group, each worker's heartbeat.")
    add_inspect_arguments(inspect)

    bench = sub.add_parser("bench", help="load any OpenAI-compatible server and report "
                           "throughput, TTFT, TPOT, ITL and latency",
                           description="Load an OpenAI-compatible server (redserve, vLLM, "
                           "transformers serve...) with streamed requests and report what the "
                           "clients saw, as `vllm bench serve` does; a comma-separated "
                           "--concurrency or --request-rate runs a sweep.")
    add_bench_arguments(bench)
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "api":
        api_settings = settings_from(ApiSettings, args, "host", "port", "model",
                                     "served_model_name", "models_file", *LORA,
                                     "api_keys_file", "no_auth", *LIMITS, "placement",
                                     "allow_runtime_lora", "access_log", "log_request_text")
        _tokenizing_only(api_settings)  # before anything loads transformers
    if args.command != "bench":  # a client of any server: it needs no setting of redserve's
        logging = (name for name in LOGGING if hasattr(args, name))
        setup_logging(settings_from(Settings, args, *logging),
                      loads_models=args.command in ("up", "api", "worker"))
    if args.command in ("up", "api", "worker"):
        # A crash in native code (a kernel, a tokenizer) leaves its Python stack in the log,
        # and `kill -USR1 <pid>` writes every thread's stack there: what a stuck process is
        # doing, without a debugger.
        faulthandler.enable()
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.command == "api":
        run_api(api_settings)
    elif args.command == "worker":
        run_worker(settings_from(WorkerSettings, args, "model", "served_model_name", *LORA,
                                 "device", "dtype", "kernels", "batch_invariant",
                                 "quantization", "speculation", "speculative_tokens",
                                 "kv_cache_dtype", "threads", "decode_threads", "max_running",
                                 "max_loras", "queue_policy",
                                 "kv_cache_memory", "page_size", "max_prefill_tokens",
                                 "worker_name", "metrics_port"))
    elif args.command == "inspect":
        from ops.inspector.inspect_command import run as run_inspect

        sys.exit(run_inspect(args))
    elif args.command == "bench":
        from ops.loadtest.bench_command import run as run_bench

        sys.exit(run_bench(args))
    else:
        from ops.up import run_up

        sys.exit(run_up(args))


def _tokenizing_only(settings: ApiSettings) -> None:
    """An API replica tokenizes and never computes, yet transformers imports torch wherever it
    is installed: 2.6 CPU-s and 240 MB more per replica start, for nothing. So torch is hidden
    from this process (as in an image without it), unless this replica is the one to convert
    the default model on its first use here, which needs torch. A bad model list is left to
    `run_api` to say."""
    try:
        specs = parse_specs(settings.model, settings.served_model_name, settings.models_file)
    except (ModelNotFound, OSError):
        return
    if not converts_default(specs, settings.cache_dir):
        # None in sys.modules: `import torch` raises ImportError from here on (Python's
        # documented way), and transformers finds no torch.
        sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
        # transformers' own notice that it runs without torch: expected here.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _require_redis(settings: Settings) -> None:
    if settings.redis_url is None:
        log.error("REDIS_URL is not set (only `redserve up` starts a server)")
        sys.exit(2)


def run_api(settings: ApiSettings) -> None:
    _require_redis(settings)
    specs = model_specs(settings)  # a bad list is the command line's: say so before the slow
    if settings.lora:  # imports, as a bad adapter is
        try:
            infos = resolve_models(specs, settings.cache_dir)
            read_adapters(lora_specs(settings), {i.name: i.path for i in infos},
                          settings.max_lora_rank)
        except (ModelNotFound, LoraError) as e:
            log.error("%s", e)
            sys.exit(2)
    from api.auth.keys import AuthConfigError
    from api.server import run
    from shared.tenants import TenantsConfigError

    try:
        run(settings)
    except (AuthConfigError, TenantsConfigError) as e:
        log.error("%s", e)
        sys.exit(2)


def run_worker(settings: WorkerSettings) -> None:
    _require_redis(settings)
    specs = model_specs(settings)
    if len(specs) > 1:
        log.error("a worker serves exactly one model, and %d are given (%s): start one worker "
                  "per model (`redserve up` does)", len(specs),
                  ", ".join(s.name or s.source for s in specs))
        sys.exit(2)
    try:
        info = resolve_model(specs[0].source, settings.cache_dir, specs[0].name)
    except ModelNotFound as e:
        log.error("%s", e)
        sys.exit(2)
    from worker.engine.build import check_loras

    try:
        check_loras(info, settings)  # before the slow load; loaded with the model
    except LoraError as e:
        log.error("cannot serve the adapters: %s", e)
        sys.exit(2)
    from worker.broker.service import serve
    from worker.engine.checkpoint import UnsupportedCheckpoint
    from worker.engine.kernels import KernelsUnavailable
    from worker.engine.linear import QuantizationUnavailable

    try:
        asyncio.run(serve(settings, info))
    except (UnsupportedCheckpoint, KernelsUnavailable, QuantizationUnavailable,
            LoraError) as e:
        log.error("cannot serve %s: %s", info.path, e)
        sys.exit(2)


if __name__ == "__main__":
    main()
