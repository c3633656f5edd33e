"""A model's queue as the scheduling scripts see it: one member per waiting request, and the
service each tenant has received.

Queued-set member (`Keys.queued`, scored by enqueue time), plain text so that a Lua script can
read it with one pattern and a person with `ZRANGE`:

    <request id>:<tenant>:<prompt tokens>:<priority>:<weight>:<placed worker>

A request id and a tenant name hold no colon; the placed worker is last, so its name may. The
admission script (shared/scripts/admit.py) counts places and prompt tokens from it; the take
script (shared/scripts/take.py) chooses from it which request a worker takes, without reading
any prompt. `QueueMember` below is its Python side; `MEMBER_LUA` in shared/scripts/handoff.py
is the one parser of it in Lua, and both scripts start with it: a change to the format is a
change to both.

Service counters (`Keys.service`, a hash): tenant -> the tokens it has been served, each
divided by its weight (prompt tokens when a worker takes a request, output tokens as they are
generated): the Virtual Token Counter of "Fairness in Serving Large Language Models" (OSDI'24).
The least-served tenant goes next.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueMember:
    request_id: str
    tenant: str
    prompt_tokens: int
    priority: int = 0  # lower goes first (vLLM's)
    weight: float = 1.0  # the tenant's fair-share weight
    worker: str = ""  # the worker placement chose; "" = any

    def encode(self) -> str:
        return (f"{self.request_id}:{self.tenant}:{self.prompt_tokens}:{self.priority}:"
                f"{self.weight:.6g}:{self.worker}")

    @classmethod
    def decode(cls, text: str | bytes) -> QueueMember:
        if isinstance(text, bytes):
            text = text.decode()
        parts = text.split(":", 5)
        if len(parts) != 6:
            raise ValueError(f"not a queued-set member: {text!r}")
        request_id, tenant, tokens, priority, weight, worker = parts
        return cls(request_id, tenant, int(tokens), int(priority), float(weight), worker)


@dataclass(frozen=True)
class ServiceCounters:
    """A model's service counters: weighted tokens served per tenant."""

    by_tenant: Mapping[str, float]

    @classmethod
    def decode(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> ServiceCounters:
        return cls({(k.decode() if isinstance(k, bytes) else k): float(v)
                    for k, v in raw.items()})

    def least(self) -> float:
        return min(self.by_tenant.values(), default=0.0)
