"""What travels through Redis.

Request stream entry: `{"id": <request id>, "body": <GenerateRequest JSON>}`; a traced request's
body carries its replica span's W3C `traceparent` (shared/tracing.py), an untraced one none.

Result stream entries (one stream per request, read by the API replica that owns the request):
    kind=tokens  index=<position of the first id>  ids=<comma-separated token ids>
                 [logprobs=<JSON: per token [logprob, [[id, logprob], ...top alternatives]]>]
                 [queued_ms=<created -> admitted by the worker; on a request's first token>]
    kind=finish  finish_reason=stop|length|abort  prompt_tokens=N  completion_tokens=N
                 cached_tokens=N  [index=.. ids=.. logprobs=..: the request's last tokens]
    kind=error   type=<error type>  code=<code>  message=<text>
Feed entry (one per worker step per replica, see `shared.keys`): `d=<JSON {<request id>: that
request's result entry fields}>` for each of the replica's requests the step produced.
Exactly one `finish` or `error` entry ends every result stream. The result stream is the
record, written in chunks (a request's first token at once, then every 16 tokens or 0.5 s:
worker/broker/record.py); the feed is the live path, one entry per step, kept `FEED_RETENTION_S`. A
finish entry carries the tokens not yet recorded (one XADD instead of two: Redis commands per
token are the budget), read as a tokens entry followed by the finish (`expand`); a reply is
rendered one token at a time, so it does not depend on the chunks. Flat string
fields keep the streams readable with plain `redis-cli XRANGE`.

Request hash (`RequestField` names its fields, `RequestHash` writes and reads them): written in
parts, by the replica that accepts the request and by the worker that runs it; read by any
replica (cancel, resume) and by `redserve inspect`.
Heartbeat (`Heartbeat`): a worker's status as JSON, rewritten on every beat.
Rate-limit bucket hash (`BucketField` names its fields, `Bucket` reads them): a tenant's
request and token levels for one model, written by the replicas' admission and settle scripts.
Queued-set member (`QueueMember`) and service counters (`ServiceCounters`): see `queue`.
The Lua scripts that write these keys atomically, with typed KEYS, ARGV and replies, are in
`shared.scripts` (the admission→take hand-off: `shared.scripts.handoff`).
A LoRA adapter loaded at run time (`RuntimeLora`): JSON, one field of its model's adapter
registry hash, written by the replica that loaded it and read by every replica.
A worker's prefix summary (`PrefixSummary`): the public digests of its cached pages, binary.
A stored Responses API reply (`StoredResponse`, fields `StoredResponseField`): JSON fields of one
hash, written and read by the replicas only.
"""

from __future__ import annotations

from shared.messages.heartbeat import Heartbeat, KernelSet
from shared.messages.limits import BUCKET_TTL_MS, WINDOW_MS, Bucket, BucketField
from shared.messages.loras import RuntimeLora
from shared.messages.prefix_summary import PrefixSummary
from shared.messages.queue import QueueMember, ServiceCounters
from shared.messages.requests import FinishReason, GenerateRequest, SamplingParams
from shared.messages.responses import ResponsesStream, StoredResponse, StoredResponseField
from shared.messages.results import (
    FEED_RETENTION_S,
    Error,
    Finish,
    ResultEntry,
    TokenLogprob,
    Tokens,
    decode_feed,
    decode_result,
    expand,
    feed_fields,
    feed_marker,
    feed_min_id,
    feed_payload,
    is_terminal,
    no_worker,
    queue_timeout,
)
from shared.messages.state import RequestField, RequestHash, RequestState

__all__ = [
    "BUCKET_TTL_MS",
    "FEED_RETENTION_S",
    "WINDOW_MS",
    "Bucket",
    "BucketField",
    "Error",
    "Finish",
    "FinishReason",
    "GenerateRequest",
    "Heartbeat",
    "KernelSet",
    "PrefixSummary",
    "QueueMember",
    "RequestField",
    "RequestHash",
    "RequestState",
    "ResponsesStream",
    "ResultEntry",
    "RuntimeLora",
    "SamplingParams",
    "ServiceCounters",
    "StoredResponse",
    "StoredResponseField",
    "TokenLogprob",
    "Tokens",
    "decode_feed",
    "decode_result",
    "expand",
    "feed_fields",
    "feed_marker",
    "feed_min_id",
    "feed_payload",
    "is_terminal",
    "no_worker",
    "queue_timeout",
]
