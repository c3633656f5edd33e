"""`redserve up`: the whole system as one supervised process tree on this machine.

Redis (embedded unless `REDIS_URL` is set), then every worker and API replica as children of
`ops.supervisor`, each started with its own `redserve` command line, so `up` runs exactly what
pods run. `ready` is logged only once every replica answers and counts a live worker for every
model: that is what a user waits for before sending a request. What `up` says goes through
logging like everything its children say (`--log-format json`: one JSON object a line, all of
it), and the children are told to log as `up` was.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import time

import httpx

from ops.options import LIMITS, LOGGING, LORA, console, lora_specs, model_specs, settings_from
from ops.supervisor import ChildSpec, Supervisor
from shared.lora import LoraError, check_compute, parse_lora_specs, read_adapters
from shared.models import ModelInfo, ModelNotFound, resolve_models
from shared.redis_address import public
from shared.settings import ApiSettings, WorkerSettings

# `up` names each model on its children's command lines; the same settings in its environment
# would add to them.
_MODEL_ENV = ("REDSERVE_MODEL", "REDSERVE_SERVED_MODEL_NAME", "REDSERVE_MODELS_FILE",
              "REDSERVE_LORA", "REDSERVE_MAX_LORA_RANK")
log = logging.getLogger("redserve.up")

# The worker settings `up` takes as options and hands to each worker as the same flags.
WORKER_FLAGS = ("device", "dtype", "kernels", "quantization", "kv_cache_dtype", "threads",
                "decode_threads", "max_running", "queue_policy", "kv_cache_memory", "page_size",
                "max_prefill_tokens", "speculation", "speculative_tokens", "max_loras")


def run_up(args: argparse.Namespace) -> int:
    host = args.host or "127.0.0.1"
    settings = settings_from(ApiSettings, args, "port", "model", "served_model_name",
                             "models_file", *LORA, "api_keys_file", "no_auth", *LIMITS, "placement",
                             "allow_runtime_lora", "access_log", *LOGGING)
    # The workers' settings too, though `up` passes them on as flags: a bad one is said now,
    # in one line, not by every worker as the supervisor restarts it.
    worker = settings_from(WorkerSettings, args, *WORKER_FLAGS, "batch_invariant")
    auth_env = _auth_env(settings, host)
    _check_tenants(settings)
    specs = model_specs(settings)
    preparing = "preparing the model(s) (the first start converts the default one)"
    # A spinner is for a person at a terminal; a log collector gets a line.
    if settings.log_format == "json":
        log.info(preparing)
    with (console.status(preparing) if settings.log_format == "text"
          else contextlib.nullcontext()):
        try:
            infos = resolve_models(specs, settings.cache_dir)
            adapters = read_adapters(lora_specs(settings), {i.name: i.path for i in infos},
                                     settings.max_lora_rank)
            check_compute(len(adapters), worker.batch_invariant)
        except (ModelNotFound, LoraError) as e:
            log.error("%s", e)
            return 2
    for info in infos:
        log.info("model %s at %s", info.name, info.path)
    for name, (base, adapter) in adapters.items():
        log.info("LoRA adapter %s over %s at %s (rank %d)", name, base, adapter.path,
                 adapter.rank)
    from ops.embedded_redis import EmbeddedRedis

    stop = {"signal": 0, "roll": 0}

    def on_signal(signum: int, _: object) -> None:
        stop["signal"] = signum

    def on_roll(signum: int, _: object) -> None:
        stop["roll"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # Not SIGHUP: a terminal that closes sends it, and must stop `up`, not restart it.
    signal.signal(signal.SIGUSR2, on_roll)
    embedded: EmbeddedRedis | None = None
    env = {k: v for k, v in os.environ.items() if k.upper() not in _MODEL_ENV}
    env.update(auth_env)
    if settings.redis_url is None:
        embedded = EmbeddedRedis()
        env["REDIS_URL"] = embedded.start()
        log.info("embedded Valkey at %s", env["REDIS_URL"])
    else:
        _say_if_redis_is_down(settings.redis_url, settings.redis_cluster)
    ports = [settings.port + i for i in range(args.replicas)]
    local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    local = f"[{local}]" if ":" in local else local
    names = [info.name for info in infos]
    children = _up_children(args, infos, host, [f"http://{local}:{port}" for port in ports],
                            settings)

    supervisor = Supervisor(children, env)
    ready, next_probe = False, 0.0
    try:
        supervisor.start()
        while not stop["signal"]:
            if stop["roll"]:  # SIGUSR2: every replica and worker restarted, one at a time
                stop["roll"] = 0
                supervisor.roll(settings.drain_grace_s + 10, lambda: bool(stop["signal"]))
            supervisor.poll()
            if not ready and time.monotonic() >= next_probe:
                ready = all(_replica_ready(f"http://{local}:{port}", names) for port in ports)
                next_probe = time.monotonic() + 0.5
                if ready:
                    urls = [f"http://{host}:{port}/v1" for port in ports]
                    log.info("ready: %s (model%s %s; %d worker%s%s); Ctrl-C stops everything",
                             ", ".join(urls), "s" if len(names) > 1 else "", ", ".join(names),
                             args.workers, "s" if args.workers > 1 else "",
                             " each" if len(names) > 1 else "",
                             extra={"fields": {"event": "up.ready", "urls": urls,
                                               "models": names,
                                               "workers_per_model": args.workers}})
            time.sleep(0.2)
        log.info("stopping: the replicas and workers drain",
                 extra={"fields": {"event": "up.stopping", "signal": stop["signal"]}})
    finally:
        # Past their own drain, children are killed.
        supervisor.stop(grace=settings.drain_grace_s + 10)
        if embedded is not None:
            embedded.stop()
    return 0


def _up_children(args: argparse.Namespace, infos: list[ModelInfo], host: str,
                 urls: list[str], settings: ApiSettings) -> list[ChildSpec]:
    """`--workers` workers per model, each with its share of the cores, then the replicas,
    each serving every model on its URL; all of them log as `up` was told to. A worker is ready
    once a replica lists it live, a replica once it serves (what a rolling restart waits for)."""
    from worker.engine.threads import usable_cpus

    processes = args.workers * len(infos)
    cores = usable_cpus()
    if args.threads is None and "REDSERVE_THREADS" not in os.environ:
        args.threads = max(1, cores // processes)
    worker_flags = [f for name in WORKER_FLAGS if getattr(args, name) is not None
                    for f in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    if args.batch_invariant:
        worker_flags.append("--batch-invariant")
    # Adapters on the command lines of both, as models are: the replicas list and route them,
    # the workers load them.
    loras = [f for spec in parse_lora_specs(settings.lora)
             for f in ("--lora", f"{spec.name}={spec.path.resolve()}")]
    if loras:
        loras += ["--max-lora-rank", str(settings.max_lora_rank)]
    logs = ["--log-format", settings.log_format, "--log-level", settings.log_level]
    if settings.log_request_text:
        logs.append("--log-request-text")
    me = (sys.executable, "-m", "ops.cli")
    children = []
    for m, info in enumerate(infos):
        for i in range(args.workers):
            # Stable across restarts: a restarted worker takes back what is pending under it.
            name = f"{socket.gethostname()}-up{os.getpid()}-{m}-{i}"
            children.append(ChildSpec(f"worker {name} ({info.name})", (
                *me, "worker", "--model", str(info.path), "--served-model-name", info.name,
                "--name", name, *loras, *worker_flags, *logs),
                functools.partial(_worker_live, urls, name)))
    every_model = [f for info in infos for f in ("--model", f"{info.name}={info.path}")]
    access = ["--access-log"] if settings.access_log else []
    limits = [f for name in LIMITS if getattr(args, name) is not None
              for f in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    placement = ["--placement", args.placement] if args.placement else []
    runtime_lora = ["--allow-runtime-lora"] if settings.allow_runtime_lora else []
    models = [info.name for info in infos]
    replicas = [ChildSpec(f"API replica :{url.rsplit(':', 1)[1]}", (
        *me, "api", "--host", host, "--port", url.rsplit(":", 1)[1], *every_model, *loras,
        *limits,
        *placement, *runtime_lora, *logs, *access),
        functools.partial(_replica_ready, url, models))
        for url in urls]
    return children + replicas


def _say_if_redis_is_down(url: str, cluster: bool) -> None:
    """One line if the external Redis does not answer yet: nothing stops for it, the replicas
    and workers wait for it (and `ready` waits for them). Asked as they ask it (a Sentinel URL
    through its Sentinels, a Cluster as one)."""
    import redis

    from shared.redis_conn import connect

    async def ping() -> None:
        clients = connect(url, name="redserve-up", max_connections=1, cluster=cluster)
        try:
            await clients.commands.ping()
        finally:
            await clients.close()

    try:
        asyncio.run(ping())
    except redis.RedisError as e:
        log.warning("Redis at %s does not answer yet (%s); the replicas and workers wait for "
                    "it", public(url), e)


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


def _worker_live(urls: list[str], name: str) -> bool:
    """A replica lists worker `name` live (its heartbeat is there, and it is not draining)."""
    for url in urls:
        try:
            workers = httpx.get(f"{url}/health", timeout=1.0).json().get("workers")
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if isinstance(workers, dict) and name in workers:
            return True
    return False


def serves_all(ready_body: object, models: list[str]) -> bool:
    """Whether a /ready answer counts a live worker for each of `models`."""
    live = ready_body.get("models") if isinstance(ready_body, dict) else None
    return isinstance(live, dict) and all(
        isinstance(live.get(m), int) and live[m] >= 1 for m in models)


def _auth_env(settings: ApiSettings, host: str) -> dict[str, str]:
    """What the replicas need to know about authentication; exits if keys are required and
    none is set."""
    from api.auth.keys import APIKeys, AuthConfigError

    try:
        keys = APIKeys.load(settings.api_keys, settings.api_keys_file)
    except AuthConfigError as e:
        log.error("%s", e)
        sys.exit(2)
    file_env = ({"REDSERVE_API_KEYS_FILE": str(settings.api_keys_file)}
                if settings.api_keys_file else {})
    if keys.enabled:
        log.info("authentication on: %d API key(s)", len(keys.by_digest))
        return file_env
    if not settings.no_auth and not _is_loopback(host):
        log.error("no API keys, and %s is not a loopback address: set REDSERVE_API_KEYS or "
                  "--api-keys-file, or pass --no-auth to serve without authentication", host)
        sys.exit(2)
    log.warning("authentication is off (no API key set; listening on %s); set "
                "REDSERVE_API_KEYS or --api-keys-file to require keys", host)
    return {"REDSERVE_NO_AUTH": "true"}


def _check_tenants(settings: ApiSettings) -> None:
    """A tenants file the replicas would refuse, refused here, once, before anything starts."""
    from shared.tenants import TenantsConfigError, tenant_policies

    try:
        policies = tenant_policies(settings)
    except TenantsConfigError as e:
        log.error("%s", e)
        sys.exit(2)
    if settings.tenants_file is not None:
        log.info("tenants file %s: %d tenant(s)", settings.tenants_file, len(policies.tenants))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
