"""A request as the worker holds it while it queues, runs, is preempted and runs again.

One mutable record per request, shared by the scheduler (its pages and how far its KV is
computed) and the engine (its tokens, sampling state and grammar), so that a preempted request
keeps its output and its generator's state and only its KV has to be recomputed. It lives in its
own module because both sides import it and neither should import the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.messages import GenerateRequest
from worker.engine.constraint import Constraint
from worker.engine.drafting.adaptive import Drafting


# eq=False: a request is itself only (the scheduler finds and removes it by identity, and two
# requests may hold equal tokens).
@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    tokens: list[int]
    capacity: int  # prompt + completion tokens this request may hold
    generator: torch.Generator | None
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    cache_root: bytes = b""  # where its prefix-cache chain starts: its tenant's and adapter's
    # root, set when the scheduler queues it (roots are keyed by its page manager's secret)
    pages: list[int] = field(default_factory=list)  # the page table
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages
    num_computed: int = 0  # tokens whose KV is in its pages
    num_cached: int = 0  # prompt tokens taken from the prefix cache at first admission
    admitted: bool = False
    admitted_at: float = 0.0  # unix time of its first admission
    constraint: Constraint | None = None  # its grammar's matcher, fed every output token
    drafting: Drafting | None = None  # its draft index and length, once it speculated

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt
