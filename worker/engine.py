"""Continuous batching over the paged KV cache.

Requests join and leave between steps. Each step schedules, in order:
1. one decode token for every running request whose prompt is done (oldest first); when no
   page is left for one, the newest running request is preempted: its pages go back and it
   returns to the head of the queue, to be recomputed (cheaply, from its published pages);
2. the next chunk of every request still in prefill, under the per-step token budget;
3. new requests from the queue, while the budget, the running cap and the free pages allow;
   each first takes whatever full pages of its prompt the prefix cache holds.
Then one forward pass runs every chunk, and a token is sampled for each request whose chunk
reached the end of its tokens, its logits first masked by its grammar when it has one
(`worker.constraint`).

Not thread-safe by design: the worker service calls `add`/`abort` only between steps, while
`step` runs on the compute thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.messages import Error, FinishReason, GenerateRequest, TokenLogprob
from worker.constraint import Constraint, ConstraintError, Constraints, suppress
from worker.kv_cache import KVPool, KVShape
from worker.model_runner import Chunk
from worker.pages import PageManager
from worker.sampler import Row, SamplingError, make_generator, sample
from worker.threads import ThreadPolicy


class Runner(Protocol):
    """What the engine needs of a model: `worker.model_runner.ModelRunner`, or the
    benchmark-only `worker.synthetic.SyntheticRunner`."""

    kv_shape: KVShape

    @property
    def device(self) -> torch.device: ...

    def attach(self, pool: KVPool) -> None: ...

    def forward(self, chunks: Seq[Chunk]) -> torch.Tensor: ...


class AdmissionError(ValueError):
    """The request can never run on this worker."""

    def __init__(self, message: str, code: str = "context_length") -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    tokens: list[int]
    capacity: int  # prompt + completion tokens this request may hold
    generator: torch.Generator | None
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    cache_root: bytes = b""  # where its prefix-cache chain starts (its tenant's root)
    pages: list[int] = field(default_factory=list)  # the page table
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages
    num_computed: int = 0  # tokens whose KV is in its pages
    num_cached: int = 0  # prompt tokens taken from the prefix cache at first admission
    admitted: bool = False
    admitted_at: float = 0.0  # unix time of its first admission
    constraint: Constraint | None = None  # its grammar's matcher, fed every output token

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    index: int  # position of this token in the completion
    token: int | None  # None when the token was a stop token (counted, never shown)
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprob: TokenLogprob | None = None
    cached_tokens: int = 0
    error: Error | None = None  # instead of a token: this request's sampling or grammar failed
    queued_s: float | None = None  # on a fresh request's first token: created -> admitted


@dataclass(frozen=True)
class Admitted:
    """A request's first step was scheduled: it leaves the queue (its queue time ends)."""

    request: GenerateRequest
    at: float  # unix time
    resumed: int  # completion tokens an earlier worker had published (0: a fresh request)
    cached: int  # prompt tokens taken from the prefix cache


@dataclass(frozen=True)
class EngineConfig:
    max_running: int
    max_step_tokens: int  # prefill tokens scheduled per step, beside the decode tokens
    max_model_len: int
    page_size: int = 16
    prefix_caching: bool = True
    threads: ThreadPolicy | None = None  # CPU threads per step (None: leave torch's setting)


class Engine:
    def __init__(self, runner: Runner, pool: KVPool, config: EngineConfig, *,
                 eos_token_ids: tuple[int, ...], constraints: Constraints | None = None) -> None:
        self.runner = runner
        self.constraints = constraints  # None: constrained requests are refused
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        runner.attach(pool)
        self.pool = pool
        self.pages = PageManager(pool.num_pages, pool.page_size,
                                 prefix_caching=config.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # in admission order: the last is the newest
        self.num_preempted = 0
        # Since `take_admissions` was last called; bounded for an engine no service drains.
        self._admissions: deque[Admitted] = deque(maxlen=4096)
        self.num_generated = 0  # tokens sampled since start (the heartbeat's tokens/s)
        self.generator = torch.Generator(device=runner.device)  # seeded requests have their own
        self.generator.seed()

    def take_admissions(self) -> list[Admitted]:
        """Requests that left the queue for their first step since the last call."""
        admissions = list(self._admissions)
        self._admissions.clear()
        return admissions

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> list[str]:
        # Copies taken in one C call each: safe to call while a step runs on its thread.
        return [*tuple(self.running), *(s.request.id for s in tuple(self.waiting))]

    def find(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.request.id == request_id), None)
        return seq

    def add(self, request: GenerateRequest,
            generated: tuple[int, ...] = ()) -> FinishReason | None:
        """Queue a request; `generated` are tokens an earlier worker already published for it
        (a resumed request prefills them and goes on). Returns "stop", queueing nothing, when
        they complete its grammar already: only its finish entry was lost."""
        params = request.params
        num_prompt = len(request.prompt_ids)
        if num_prompt >= self.config.max_model_len:
            raise AdmissionError(
                f"prompt has {num_prompt} tokens; the model's context is "
                f"{self.config.max_model_len}"
            )
        capacity = min(num_prompt + params.max_tokens, self.config.max_model_len)
        if self.pages.pages_for(capacity) > self.pages.num_pages:
            raise AdmissionError(
                f"request needs up to {capacity} tokens of KV cache; this worker holds "
                f"{self.pages.num_pages * self.pages.page_size}"
            )
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        constraint = None
        if request.grammar is not None:
            try:
                if self.constraints is None:
                    raise ConstraintError("this worker does not run constrained requests")
                constraint = self.constraints.start(request.grammar, generated)
            except ConstraintError as e:
                raise AdmissionError(str(e), "invalid_grammar") from None
            if constraint.done:
                return "stop"
        self.waiting.append(
            Sequence(
                request=request,
                tokens=[*request.prompt_ids, *generated],
                capacity=capacity,
                generator=make_generator(params, self.runner.device),
                stop_ids=frozenset(stop),
                cache_root=self.pages.root(request.tenant),
                constraint=constraint,
            )
        )
        return None

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

    def step(self) -> list[StepOutput]:
        decodes = self._schedule_decodes()
        prefills = self._schedule_prefills(self.config.max_step_tokens, {id(s) for s, _ in decodes})
        # The runner takes multi-token chunks first; a prompt's last token after a cached
        # prefix is shaped like a decode token and runs with them.
        batch = sorted(prefills + decodes, key=lambda it: it[0].num_computed > 0 and it[1] == 1)
        if not batch:
            return []
        chunks = []
        for seq, n in batch:
            end = seq.num_computed + n
            chunks.append(Chunk(seq.tokens[seq.num_computed : end], seq.num_computed, seq.pages,
                                sample=end == len(seq.tokens)))
        if self.config.threads is not None:
            self.config.threads.apply(sum(len(c.tokens) for c in chunks))
        logits = self.runner.forward(chunks)

        sampled: list[Sequence] = []
        for (seq, n), chunk in zip(batch, chunks, strict=True):
            seq.num_computed += n
            self.pages.publish(seq.tokens, seq.pages, seq.page_keys, seq.num_computed,
                               seq.cache_root)
            if chunk.sample:
                sampled.append(seq)
        self._mask(logits, sampled)
        rows = [Row(s.request.params, s.generator, s.tokens, s.num_prompt) for s in sampled]
        return [self._fail(seq, f"sampling failed: {choice}", "sampling_failed")
                if isinstance(choice, SamplingError) else self._append(seq, *choice)
                for seq, choice in zip(sampled, sample(logits, rows, self.generator), strict=True)]

    def _mask(self, logits: torch.Tensor, sampled: list[Sequence]) -> None:
        """Grammars and `min_tokens`, on the rows that have them."""
        suppress(logits, [(i, s.stop_ids) for i, s in enumerate(sampled)
                          if s.num_output < s.request.params.min_tokens])
        if self.constraints is not None:
            self.constraints.apply(logits, [(i, s.constraint) for i, s in enumerate(sampled)
                                            if s.constraint is not None])

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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if not seq.pages:
                seq.pages, seq.page_keys = self.pages.match(seq.tokens, seq.cache_root)
                seq.num_computed = len(seq.pages) * self.pages.page_size
                if not seq.admitted:
                    seq.num_cached = min(seq.num_computed, seq.num_prompt)
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
        return scheduled

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

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> StepOutput:
        seq.tokens.append(token)
        self.num_generated += 1
        index = seq.num_output - 1
        finish: FinishReason | None = None
        shown: int | None = token
        if seq.constraint is not None:
            try:
                seq.constraint.advance(token)
            except ConstraintError as e:
                seq.tokens.pop()
                self.num_generated -= 1
                return self._fail(seq, str(e), "invalid_grammar")
        if token in seq.stop_ids:
            finish, shown = "stop", None
        elif seq.constraint is not None and seq.constraint.done:
            finish = "stop"  # the grammar is complete: nothing may follow
        elif seq.num_output >= seq.request.params.max_tokens or len(seq.tokens) >= seq.capacity:
            finish = "length"
        if finish is not None:
            del self.running[seq.request.id]
            self._release(seq)
        return StepOutput(
            request_id=seq.request.id,
            index=index,
            token=shown,
            finish=finish,
            prompt_tokens=seq.num_prompt,
            completion_tokens=seq.num_output,
            logprob=logprob if shown is not None else None,
            cached_tokens=seq.num_cached,
            # A fresh request's first token tells how long it waited for this worker.
            queued_s=max(seq.admitted_at - seq.request.created, 0.0) if index == 0 else None,
        )

    def _fail(self, seq: Sequence, message: str, code: str) -> StepOutput:
        """End one request whose sampling or grammar failed; the rest of the batch is unharmed."""
        del self.running[seq.request.id]
        self._release(seq)
        return StepOutput(seq.request.id, seq.num_output, None, None, seq.num_prompt,
                          seq.num_output, error=Error(message, "invalid_request_error", code))

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq.pages)
        seq.pages = []
        seq.page_keys = []
        seq.num_computed = 0
