"""Every Redis key redserve writes, in one place.

A request id embeds the hash tag of the API replica that accepted it (`<replica>-<random>`), and
all of that request's keys carry the tag in braces. So one replica's result streams share a
Redis Cluster slot (its single multiplexed XREAD is legal there), and any replica can derive a
request's keys from its id alone.

    {prefix}:requests                      stream, consumer group `workers`   (trimmed)
    {prefix}:queued:<model>                sorted set of requests no worker took yet (TTL)
    {prefix}:{<replica>}:<id>              hash: state, worker, counts        (TTL)
    {prefix}:{<replica>}:<id>:out          result stream: tokens, then one terminal entry (TTL)
    {prefix}:{<replica>}:<id>:abort        set to cancel                      (TTL)
    {prefix}:{<replica>}:<id>:resumed      set when a client resumes its stream (TTL)
    {prefix}:{<replica>}:wake              stream that wakes the replica's reader (TTL)
    {prefix}:worker:<name>                 heartbeat                          (TTL)
    {prefix}:workers:<model>               sorted set: live workers by heartbeat expiry (TTL)
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

WORKER_GROUP = "workers"
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

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    def queued(self, model: str) -> str:
        return f"{self.prefix}:queued:{model}"

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

    def wake(self, replica: str) -> str:
        return f"{self.prefix}:{{{replica}}}:wake"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def workers(self, model: str) -> str:
        return f"{self.prefix}:workers:{model}"
