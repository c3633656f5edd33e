"""What runs next: the queue, the running set, their KV pages, and each step's plan.

Continuous batching over the paged KV cache: requests join and leave between steps, and every
step's batch is decided here, as one `SchedulerOutput`, before the model runs. Keeping it apart
from the engine gives the page accounting a single owner: only this module allocates, reserves,
publishes and frees pages, so a page can be lost or double-freed in one file only, and the
engine is left with running a plan and sampling from its logits.

`schedule` takes, in order:
1. one decode token for every running request whose prompt is done (oldest first); when no
   page is left for one, the newest running request is preempted: its pages go back and it
   returns to the head of the queue, to be recomputed (cheaply, from its published pages).
   Decodes claim pages before any prompt chunk and don't count against the budget, so a
   decoding request advances every step unless the pool itself runs dry; the newest is
   preempted first, so requests keep the order they came in (first come, first served);
2. the next chunk of every request still in prefill, under the per-step token budget, so a
   long prompt delays running decodes by one chunk at most;
3. new requests from the queue, while the budget, the running cap and the free pages allow;
   each first takes whatever full pages of its prompt the prefix cache holds. A request whose
   next page another request of its tenant is computing (one that runs in this step) is held
   back (it keeps its place at the head of the queue and its running slot, and those behind
   it may go first) and takes the page from the cache once computed: requests arriving
   together with a new shared prefix (placement sends them to one worker: api/queue/placement.py)
   compute it once, not once each. A request naming a LoRA adapter not resident yet
   (worker/engine/lora/resident.py) keeps its place too, without holding a running slot.
4. draft tokens for the decoding requests, as the `Proposer` (worker/engine/speculation/) offers
   them under its budget: each decode chunk then carries its drafts after its token, with
   pages reserved for them only from what is free beyond one page per running request (a draft
   never preempts, nor takes the page a decode needs next).
The engine runs the plan's chunks in one forward pass, then calls `mark_computed` (the chunks'
KV is now in their pages, drafts' excepted: full pages are published to the prefix cache),
`accept` for the drafts that stood (only then is their KV counted and published; a rejected
draft's is overwritten by the next step) and `finish` for every request that ended.

Not thread-safe by design: the worker service calls `add`/`abort` only between steps, while
`schedule` runs on the compute thread; `request_ids`, `tenants` and `stats` are made safe to
call while a step runs. `stats` is how everyone else (the heartbeat, the metrics, the service)
reads the batch and the KV pool: one frozen `SchedulerStats`, so no reader depends on the queue's
or the page manager's internals.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from shared.messages import GenerateRequest
from worker.engine.chunk import Chunk
from worker.engine.pages import PageManager
from worker.engine.sequence import Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's limits on a step's batch, and the shape of the KV pool it fills."""

    max_running: int  # requests running at once, at most
    max_step_tokens: int  # prefill tokens scheduled per step, beside the decode tokens
    num_pages: int  # pages in the KV pool
    page_size: int  # tokens a page holds
    prefix_caching: bool = True


@dataclass(frozen=True)
class Admitted:
    """A request's first step was scheduled: it leaves the queue (its queue time ends)."""

    request: GenerateRequest
    at: float  # unix time
    resumed: int  # completion tokens an earlier worker had published (0: a fresh request)
    cached: int  # prompt tokens taken from the prefix cache


@dataclass(frozen=True)
class Scheduled:
    """The next `num_tokens` tokens of `seq` (from its first uncomputed one) run this step,
    followed by `drafts`, guesses of the tokens after them, to be verified."""

    seq: Sequence
    num_tokens: int
    drafts: tuple[int, ...] = ()


class Proposer(Protocol):
    """Where draft tokens come from (worker/engine/speculation/speculator.py)."""

    def propose(self, seqs: Seq[Sequence], step_tokens: int) -> list[tuple[int, ...]]:
        """Drafts for each decoding request of a step already holding `step_tokens`."""
        ...


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch, fixed before the forward pass: the engine runs `chunks` and samples
    for `sampled`, and hands the plan back to `mark_computed`. Falsy when nothing runs."""

    # In the runner's order: multi-token chunks first; a prompt's last token after a cached
    # prefix is shaped like a decode token and runs with them.
    scheduled: tuple[Scheduled, ...]
    chunks: tuple[Chunk, ...]  # scheduled[i]'s tokens, positions and page table

    def __bool__(self) -> bool:
        return bool(self.scheduled)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass runs, drafts included."""
        return sum(s.num_tokens + len(s.drafts) for s in self.scheduled)

    @property
    def sampled(self) -> list[Scheduled]:
        """The requests whose chunk reaches their last token, in the order of the logits' rows
        (the runner returns logits for those chunks only: one row, and one per draft)."""
        return [s for s, chunk in zip(self.scheduled, self.chunks, strict=True) if chunk.sample]


@dataclass(frozen=True)
class SchedulerStats:
    """The batch and the KV pool at one moment, as the heartbeat (`shared.messages.Heartbeat`)
    and the worker's metrics show them."""

    running: int  # requests in the running batch
    waiting: int  # queued for room in the batch, preempted ones included
    pages_used: int  # referenced by at least one request
    pages_free: int  # an allocation can take them: empty, or held only by the prefix cache
    pages_cached: int  # held only by the prefix cache (counted in `pages_free`)
    pages_total: int
    preempted: int  # requests preempted since start

    @property
    def requests(self) -> int:
        """Requests this scheduler holds, running or waiting."""
        return self.running + self.waiting


class Scheduler:
    def __init__(self, config: SchedulerConfig, proposer: Proposer | None = None, *,
                 lora_ready: Callable[[str], bool] | None = None) -> None:
        self.config = config
        self.proposer = proposer
        self.lora_ready = lora_ready  # whether an adapter is resident (see the docstring, 3.)
        self.pages = PageManager(config.num_pages, config.page_size,
                                 prefix_caching=config.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # in admission order: the last is the newest
        self.num_preempted = 0
        # Since `take_admissions` was last called; bounded for an engine no service drains.
        self._admissions: deque[Admitted] = deque(maxlen=4096)

    @property
    def max_tokens(self) -> int:
        """Tokens of KV the whole pool holds: a request that may grow past it can never run."""
        return self.pages.num_pages * self.pages.page_size

    def stats(self) -> SchedulerStats:
        """A snapshot; safe to call while a step runs on its thread (each figure is one read,
        and the pool's used and free pages are worked out from one count, so they add up)."""
        free = self.pages.available
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting),
            pages_used=self.pages.num_pages - free, pages_free=free,
            pages_cached=self.pages.cached, pages_total=self.pages.num_pages,
            preempted=self.num_preempted,
        )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> list[str]:
        # Copies taken in one C call each: safe to call while a step runs on its thread.
        return [*tuple(self.running), *(s.request.id for s in tuple(self.waiting))]

    def tenants(self) -> list[str]:
        """The tenant of each request here; as safe as `request_ids` during a step."""
        return [s.request.tenant for s in (*tuple(self.running.values()), *tuple(self.waiting))]

    def find(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.request.id == request_id), None)
        return seq

    def take_admissions(self) -> list[Admitted]:
        """Requests that left the queue for their first step since the last call."""
        admissions = list(self._admissions)
        self._admissions.clear()
        return admissions

    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind every waiting request; its prefix-cache chain starts at the root
        of its tenant and adapter, so neither two tenants nor two adapters share pages."""
        seq.cache_root = self.pages.root(seq.request.tenant, seq.request.lora)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its pages now. True if it was here."""
        seq = self.running.pop(request_id, None) or self.find(request_id)
        if seq is None:
            return False
        if seq in self.waiting:  # by identity: a Sequence compares as itself only
            self.waiting.remove(seq)
        self._release(seq)
        return True

    def drop_running(self) -> list[Sequence]:
        """Remove every running request (after a failed step) and free its pages."""
        dropped = list(self.running.values())
        for seq in dropped:
            self._release(seq)
        self.running.clear()
        return dropped

    def drop_waiting(self, *, unstarted_only: bool = False) -> list[Sequence]:
        """Remove queued requests; with `unstarted_only`, keep the preempted ones (they have
        published tokens, so only this engine can finish them without a repeat)."""
        dropped = [s for s in self.waiting if not (unstarted_only and s.admitted)]
        for seq in dropped:
            self._release(seq)
        self.waiting = deque(s for s in self.waiting if unstarted_only and s.admitted)
        return dropped

    def schedule(self) -> SchedulerOutput:
        """This step's batch; its pages are reserved, so the forward pass cannot run out."""
        decodes = self._schedule_decodes()
        prefills = self._schedule_prefills(self.config.max_step_tokens, {id(s) for s, _ in decodes})
        drafts = self._schedule_drafts([seq for seq, _ in decodes],
                                       sum(n for _, n in prefills + decodes))
        # Multi-token chunks first (a decode with drafts is one); a decode token alone last.
        batch = sorted((Scheduled(s, n, drafts.get(id(s), ())) for s, n in prefills + decodes),
                       key=lambda it: it.seq.num_computed > 0 and it.num_tokens + len(it.drafts)
                       == 1)
        chunks = []
        for it in batch:
            seq, end = it.seq, it.seq.num_computed + it.num_tokens
            chunks.append(Chunk([*seq.tokens[seq.num_computed : end], *it.drafts],
                                seq.num_computed, seq.pages, sample=end == len(seq.tokens),
                                logits=1 + len(it.drafts), lora=seq.request.lora))
        return SchedulerOutput(tuple(batch), tuple(chunks))

    def mark_computed(self, plan: SchedulerOutput) -> None:
        """The plan's forward pass ran: its tokens' KV is in their pages, and every page it
        filled is published for later prompts that start the same way. Drafts are not counted
        (see `accept`)."""
        for item in plan.scheduled:
            self._computed(item.seq, item.num_tokens)

    def accept(self, seq: Sequence, drafts: int) -> None:
        """The first `drafts` draft tokens of `seq`'s last step stood and are now among its
        tokens: their KV, written by that step, counts as computed (and may be published)."""
        assert seq.num_computed + drafts < len(seq.tokens), "a decode's last token stays to run"
        self._computed(seq, drafts)

    def _computed(self, seq: Sequence, n: int) -> None:
        seq.num_computed += n
        self.pages.publish(seq.tokens, seq.pages, seq.page_keys, seq.num_computed,
                           seq.cache_root)

    def finish(self, seq: Sequence) -> None:
        """`seq` ended (finished or failed): it leaves the running set and its pages go back."""
        del self.running[seq.request.id]
        self._release(seq)

    def _schedule_decodes(self) -> list[tuple[Sequence, int]]:
        scheduled: list[tuple[Sequence, int]] = []
        for seq in list(self.running.values()):
            if seq.request.id not in self.running or len(seq.tokens) - seq.num_computed != 1:
                continue  # preempted below, or still in prefill
            while not self._reserve(seq, len(seq.tokens)):
                victim = next(reversed(self.running.values()))
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, 1))
        return scheduled

    def _schedule_drafts(self, decodes: list[Sequence], step_tokens: int
                         ) -> dict[int, tuple[int, ...]]:
        """Draft tokens per decoding request (by id), as far as their pages can hold them."""
        if self.proposer is None or not decodes:
            return {}
        page_size = self.pages.page_size
        spare = self.pages.available - len(self.running)  # a page per request stays free
        drafts: dict[int, tuple[int, ...]] = {}
        for seq, draft in zip(decodes, self.proposer.propose(decodes, step_tokens), strict=True):
            room = (len(seq.pages) + max(spare, 0)) * page_size - len(seq.tokens)
            draft = draft[: max(room, 0)]
            if draft:
                spare -= self.pages.pages_for(len(seq.tokens) + len(draft)) - len(seq.pages)
                self._reserve(seq, len(seq.tokens) + len(draft))
                drafts[id(seq)] = draft
        return drafts

    def _schedule_prefills(self, budget: int, busy: set[int]) -> list[tuple[Sequence, int]]:
        scheduled: list[tuple[Sequence, int]] = []
        for seq in list(self.running.values()):
            remaining = len(seq.tokens) - seq.num_computed
            if seq.request.id not in self.running or remaining <= 1 or budget <= 0:
                continue
            n = self._fit(seq, min(remaining, budget))
            while n == 0:
                # Out of pages with prompts half-done: the newest request not yet in this step
                # makes room (possibly this one), so some prefill always progresses.
                victim = next(s for s in reversed(self.running.values()) if id(s) not in busy)
                self._preempt(victim)
                if victim is seq:
                    break
                n = self._fit(seq, min(remaining, budget))
            if n:
                scheduled.append((seq, n))
                busy.add(id(seq))
                budget -= n
        held: list[Sequence] = []  # back to the queue's head, in their order, after the loop
        holding = 0  # of them, those that keep a running slot: none goes to those behind
        while (self.waiting and budget > 0
               and len(self.running) + holding < self.config.max_running):
            seq = self.waiting[0]
            lora = seq.request.lora
            if lora and self.lora_ready is not None and not self.lora_ready(lora):
                held.append(self.waiting.popleft())  # its adapter is being loaded
                continue
            if not seq.pages:
                seq.pages, seq.page_keys = self.pages.match(seq.tokens, seq.cache_root)
                seq.num_computed = len(seq.pages) * self.pages.page_size
                if not seq.admitted:
                    seq.num_cached = min(seq.num_computed, seq.num_prompt)
            if self._next_page_in_step(seq, scheduled):
                self._release(seq)
                held.append(self.waiting.popleft())
                holding += 1
                continue
            # Admit only a prompt whose every page is free now, so that half-done prompts
            # don't crowd each other out; its first chunk may still be smaller.
            if self.pages.pages_for(len(seq.tokens)) - len(seq.pages) > self.pages.available:
                self._release(seq)  # hold no cached pages while waiting
                break  # for running requests to free pages
            n = self._fit(seq, min(len(seq.tokens) - seq.num_computed, budget))
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted_at = time.time()
                self._admissions.append(Admitted(seq.request, seq.admitted_at, seq.num_output,
                                                 seq.num_cached))
            seq.admitted = True
            self.running[seq.request.id] = seq
            scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        return scheduled

    def _next_page_in_step(self, seq: Sequence, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether a request that runs in this step is computing the first page `seq` lacks
        (same tenant, same tokens up to that page's end): a page `seq` would compute again.
        That request progresses every step it runs, so `seq` waits a few steps at most."""
        end = (len(seq.pages) + 1) * self.pages.page_size
        if not self.config.prefix_caching or end >= len(seq.tokens):
            return False  # nothing to share, or no full page left: its last token always runs
        head = seq.tokens[:end]
        return any(other.cache_root == seq.cache_root and other.num_computed < end
                   <= len(other.tokens) and other.tokens[:end] == head
                   for other, _ in scheduled)

    def _fit(self, seq: Sequence, n: int) -> int:
        """Reserve pages for up to `n` more tokens of `seq`; returns how many fit."""
        page_size = self.pages.page_size
        room = (len(seq.pages) + self.pages.available) * page_size - seq.num_computed
        n = min(n, room)
        if n > 0:
            self._reserve(seq, seq.num_computed + n)
        return max(n, 0)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s page table cover `num_tokens` tokens."""
        needed = self.pages.pages_for(num_tokens) - len(seq.pages)
        if needed <= 0:
            return True
        pages = self.pages.allocate(needed)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.request.id]
        self._release(seq)
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def _release(self, seq: Sequence) -> None:
        """Give back `seq`'s pages and forget its KV; it keeps its tokens, so it can be
        scheduled again from scratch (mostly from the prefix cache)."""
        self.pages.release(seq.pages)
        seq.pages = []
        seq.page_keys = []
        seq.num_computed = 0
