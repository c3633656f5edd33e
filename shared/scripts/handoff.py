"""The hand-off from admission (an API replica) to take (a worker), as types.

The two scripts never call each other; they agree on what a queued request leaves in its
model's keys, all in the model's Cluster slot (`ModelQueue`):
- its member in the queued set, scored by enqueue time (`QueueMember` in
  shared/messages/queue.py encodes and decodes it in Python; `MEMBER_LUA` below is the one
  parser of it in Lua, and both scripts start with it);
- its entry on the request stream, delivered at once by the admission script to the queue's
  own consumer (`QUEUED_CONSUMER`) of the workers' group (`WORKER_GROUP`; both named in
  shared/keys.py and embedded in the scripts by `NAMES_LUA`), so it is pending there, and no
  worker's plain XREADGROUP reads it;
- its entry id under its request id in the entries hash (`QueuedEntries`), so the take script
  finds the entry of the member it chooses and XCLAIMs that one, not the next in the stream.
Admission also lifts the tenant's service counter on its return to the queue; take charges
it: the counters are `ServiceCounters` (shared/messages/queue.py), keyed `service` here.
A worker's liveness (`workers`, refreshed by its heartbeat) tells take whether a member placed
on a worker may go to another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.keys import QUEUED_CONSUMER, WORKER_GROUP, Keys
from shared.scripts.base import lua_string


@dataclass(frozen=True)
class ModelQueue:
    """One model's queue keys (every one carries the model's hash tag: one slot)."""

    queued: str  # sorted set of `QueueMember`s by enqueue time
    requests: str  # the request stream, group `WORKER_GROUP`
    entries: str  # hash: request id -> its stream entry id (`QueuedEntries`)
    service: str  # hash: tenant -> weighted tokens served (`ServiceCounters`)
    workers: str  # sorted set: live workers by heartbeat expiry

    @classmethod
    def of(cls, keys: Keys, model: str) -> ModelQueue:
        return cls(keys.queued(model), keys.requests(model), keys.entries(model),
                   keys.service(model), keys.workers(model))


@dataclass(frozen=True)
class QueuedEntries:
    """The entries hash, decoded: the stream entry of each queued request."""

    by_request: Mapping[str, str]  # request id -> entry id

    @classmethod
    def decode(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> QueuedEntries:
        return cls({(k.decode() if isinstance(k, bytes) else k):
                    (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()})


# Lua: the group's and the queue consumer's names, as the locals GROUP and QUEUED.
NAMES_LUA = f"""
local GROUP, QUEUED = {lua_string(WORKER_GROUP)}, {lua_string(QUEUED_CONSUMER)}
"""

# Lua: parse_member(text) -> table with the member's fields, or nil for a foreign member
# (the format: `QueueMember` in shared/messages/queue.py).
MEMBER_LUA = """
local function parse_member(text)
  local id, tenant, tokens, priority, weight, worker =
    string.match(text, '^([^:]*):([^:]*):(%d+):(%-?%d+):([^:]*):(.*)$')
  if not id then return nil end
  return {id = id, tenant = tenant, tokens = tonumber(tokens), priority = tonumber(priority),
          weight = tonumber(weight) or 1, worker = worker, member = text}
end
"""
