"""Every Redis key redserve writes, in one place.

A request id embeds the hash tag of the API replica that accepted it (`<replica>-<random>`), and
all of that request's keys carry the tag in braces. So one replica's feed and all its requests'
keys share a Redis Cluster slot, and any replica can derive a request's keys from its id alone.
A model's keys carry the model's name as their hash tag: its queue, its request stream and its
tenants' rate-limit buckets share a slot, so one script can check a tenant's limits, admit and
enqueue a request (and the limits are per model, as OpenAI's are).

    {prefix}:model:{<model>}:requests      stream of unfinished requests, group `workers` (TTL)
    {prefix}:model:{<model>}:queued        sorted set of requests no worker took yet (TTL)
    {prefix}:model:{<model>}:entries       hash: queued request id -> its stream entry (TTL)
    {prefix}:model:{<model>}:service       hash: tenant -> weighted tokens served (TTL)
    {prefix}:model:{<model>}:workers       sorted set: live workers by heartbeat expiry (TTL)
    {prefix}:model:{<model>}:limits:<tenant>  hash: `messages.BucketField` (rate limits) (TTL)
    {prefix}:model:{<model>}:loras         hash: adapter name -> `messages.RuntimeLora` JSON,
                                           the adapters loaded at run time (no TTL: unload)
    {prefix}:{<replica>}:<id>              hash: `messages.RequestField`      (TTL)
    {prefix}:{<replica>}:<id>:out          result stream: tokens, then one terminal entry (TTL)
    {prefix}:{<replica>}:<id>:abort        set to cancel: the source of truth (TTL)
    {prefix}:{<replica>}:<id>:resumed      set when a client resumes its stream (TTL)
    {prefix}:{<replica>}:<id>:response     hash: a stored `/v1/responses` reply,
                                           `messages.StoredResponseField` (retention TTL)
    {prefix}:{<replica>}:feed              stream: every result entry for the replica (TTL)
    {prefix}:aborts                        stream announcing abort keys as they are set (TTL)
    {prefix}:worker:<name>                 heartbeat: `messages.Heartbeat`    (TTL)
    {prefix}:prefixes:<name>               a worker's cached pages: `messages.PrefixSummary` (TTL)

A request waiting in the queue is pending in the group under the consumer `QUEUED_CONSUMER`
(the admission script delivers it there at once), so a worker takes the one it chooses with
XCLAIM (the take script) rather than the next in the stream; recovery never claims from that
consumer. That hand-off is typed in `shared.scripts.handoff`, beside the scripts themselves.
What each key holds is typed in `shared.messages`: the stream entries, the request hash's
fields (`RequestField`, read and written through `RequestHash`) and the heartbeat's body
(`Heartbeat`), the rate-limit bucket's fields (`BucketField`) and the queue's member and
service counters (`QueueMember`, `ServiceCounters`); nothing else spells a field's name.

A request stream holds only work not yet finished: a worker deletes an entry (XACK + XDEL) when
it writes the request's terminal entry, and entries older than the request TTL are trimmed as
new ones arrive, so no prompt outlives its request's TTL. Each new request extends the
stream's TTL to a request TTL and its workers refresh it; with no worker it expires a request
TTL after its last request (its consumer group goes with it; a worker makes both anew).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

WORKER_GROUP = "workers"
# The consumer of the group that holds queued requests until a worker takes one (no worker
# name starts with `~`: see `Settings.worker_name`).
QUEUED_CONSUMER = "~queued"
# A queued-set member older than the queue timeout plus this is stale (its request can no
# longer be taken): admission trims it, and every queue-depth figure leaves it out.
QUEUE_STALE_MARGIN_S = 5.0
# `<replica>-<random>`, and `-<i>` for choice i > 0 of a reply (see `new_request_id`).
_REQUEST_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{24}(-[0-9]{1,4})?$")


def new_replica_tag() -> str:
    return secrets.token_hex(4)


def new_request_id(replica: str) -> str:
    # 96 random bits: globally unique across replicas and restarts without coordination.
    return f"{replica}-{secrets.token_hex(12)}"


def is_request_id(text: str) -> bool:
    """Whether `text` has the shape of an id this system hands out (so that an id a client
    sends can never name another kind of key, such as `<id>:out`)."""
    return _REQUEST_ID.match(text) is not None


def replica_of(request_id: str) -> str:
    replica, sep, rest = request_id.partition("-")
    if not sep or not replica or not rest:
        raise ValueError(f"malformed request id {request_id!r}")
    return replica


@dataclass(frozen=True)
class Keys:
    prefix: str

    def _model(self, model: str) -> str:
        return f"{self.prefix}:model:{{{model}}}"

    def requests(self, model: str) -> str:
        return f"{self._model(model)}:requests"

    def queued(self, model: str) -> str:
        return f"{self._model(model)}:queued"

    def workers(self, model: str) -> str:
        return f"{self._model(model)}:workers"

    def limits(self, model: str, tenant: str) -> str:
        """A tenant's rate-limit bucket for the model (`shared.messages.limits`)."""
        return f"{self._model(model)}:limits:{tenant}"
    def loras(self, model: str) -> str:
        """The LoRA adapters loaded over the model at run time (`shared.messages.loras`): a
        registry, so no TTL; an entry goes when the adapter is unloaded."""
        return f"{self._model(model)}:loras"

    def entries(self, model: str) -> str:
        return f"{self._model(model)}:entries"

    def service(self, model: str) -> str:
        return f"{self._model(model)}:service"

    @property
    def aborts(self) -> str:
        return f"{self.prefix}:aborts"

    def _base(self, request_id: str) -> str:
        return f"{self.prefix}:{{{replica_of(request_id)}}}:{request_id}"

    def state(self, request_id: str) -> str:
        return self._base(request_id)

    def out(self, request_id: str) -> str:
        return f"{self._base(request_id)}:out"

    def abort(self, request_id: str) -> str:
        return f"{self._base(request_id)}:abort"

    def resumed(self, request_id: str) -> str:
        return f"{self._base(request_id)}:resumed"

    def response(self, request_id: str) -> str:
        """A stored Responses API reply (`resp_<request id>`): beside its request's keys, so
        any replica derives it from the response id alone, but with a TTL of its own
        (`response_ttl_s`): it outlives the request by design."""
        return f"{self._base(request_id)}:response"

    def feed(self, replica: str) -> str:
        return f"{self.prefix}:{{{replica}}}:feed"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def prefixes(self, name: str) -> str:
        """A worker's prefix summary, beside (not under) its heartbeat: a worker's name may
        hold a colon, and `worker:<name>` is the heartbeat's whole pattern."""
        return f"{self.prefix}:prefixes:{name}"
