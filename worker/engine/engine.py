"""The worker's engine: one step at a time, schedule -> run -> postprocess.

`step` asks the scheduler (`worker.engine.scheduler`, which owns the queue, the running set and
every KV page) for this step's plan, runs the plan's chunks through the model in one forward pass,
then samples a token for each request whose chunk reached the end of its tokens, its logits
first masked by its grammar when it has one (`worker.engine.constraint`) and its stop tokens while
`min_tokens` is not reached. What a token means for its request (a stop, a complete grammar,
the length limit) is decided here; the scheduler only hears that the request finished.

A decoding request may also carry draft tokens (`worker.engine.speculation`): its chunk returns a
row of logits per draft too, every row is sampled, and the request emits the drafts that were
sampled in their place and the token after them, several `StepOutput`s in order, each checked
as a token of its own (a stop or the length limit ends it there; nothing past it is emitted).

The scheduler is public (`Engine.scheduler`) and the engine does not repeat its interface:
whoever reads the queue or the KV pool (`Scheduler.stats` for the figures), or finds, aborts or
drops requests, asks the scheduler itself. The engine's own are what needs the model: admitting
a request (`add`: its context, its grammar, its stop tokens) and the step.

Not thread-safe by design: the worker service calls `add` and the scheduler's `abort` only
between steps, while `step` runs on the compute thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.lora import LoraError
from shared.messages import Error, FinishReason, GenerateRequest, TokenLogprob
from worker.engine.chunk import Chunk
from worker.engine.constraint import ConstraintError, Constraints, suppress
from worker.engine.kernels import Kernels
from worker.engine.kv_cache import KVPool, KVShape
from worker.engine.lora.resident import Residency
from worker.engine.sampler import Row, Sampled, SamplingError, make_generator, sample
from worker.engine.scheduler import Scheduled, Scheduler, SchedulerConfig, SchedulerOutput
from worker.engine.sequence import Sequence
from worker.engine.speculation import verify
from worker.engine.speculation.speculator import (
    NO_SPECULATION,
    SpeculationConfig,
    Speculator,
)
from worker.engine.threads import ThreadChooser, ThreadPolicy

# With nothing to run but requests whose adapters are being read: how long a step waits for
# a read to end before it returns (the service then hears new requests and aborts).
LORA_WAIT_S = 0.05


class Runner(Protocol):
    """What the engine needs of a model: `worker.engine.model_runner.ModelRunner`, or the
    benchmark-only `worker.engine.synthetic.SyntheticRunner`."""

    kv_shape: KVShape
    kernels: Kernels  # what it computes attention, norms and rotary with

    @property
    def device(self) -> torch.device: ...

    def attach(self, pool: KVPool) -> None: ...

    def forward(self, chunks: Seq[Chunk]) -> torch.Tensor: ...


class AdmissionError(ValueError):
    """The request can never run on this worker."""

    def __init__(self, message: str, code: str = "context_length") -> None:
        super().__init__(message)
        self.code = code


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
class EngineConfig:
    max_running: int
    max_step_tokens: int  # prefill tokens scheduled per step, beside the decode tokens
    max_model_len: int
    page_size: int = 16
    prefix_caching: bool = True
    threads: ThreadPolicy | None = None  # CPU threads per step (None: leave torch's setting)
    speculation: SpeculationConfig = NO_SPECULATION
    # The LoRA adapters its runner holds and loads (worker/engine/build.py's attach_loras);
    # None: it serves none.
    loras: Residency | None = None


class Engine:
    def __init__(self, runner: Runner, pool: KVPool, config: EngineConfig, *,
                 eos_token_ids: tuple[int, ...], constraints: Constraints | None = None) -> None:
        self.runner = runner
        self.constraints = constraints  # None: constrained requests are refused
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        runner.attach(pool)
        self.pool = pool
        self.speculator = Speculator(config.speculation)  # its counters: `.stats()`
        self.scheduler = Scheduler(SchedulerConfig(
            max_running=config.max_running, max_step_tokens=config.max_step_tokens,
            num_pages=pool.num_pages, page_size=pool.page_size,
            prefix_caching=config.prefix_caching,
        ), self.speculator if config.speculation.method != "off" else None,
            lora_ready=config.loras.holds if config.loras is not None else None)
        self.num_generated = 0  # tokens sampled since start (the heartbeat's tokens/s)
        self.generator = torch.Generator(device=runner.device)  # seeded requests have their own
        self.generator.seed()
        self.threads = ThreadChooser(config.threads) if config.threads is not None else None

    def add(self, request: GenerateRequest,
            generated: tuple[int, ...] = ()) -> FinishReason | None:
        """Queue a request; `generated` are tokens an earlier worker already published for it
        (a resumed request prefills them and goes on). Returns "stop", queueing nothing, when
        they complete its grammar already: only its finish entry was lost."""
        params = request.params
        num_prompt = len(request.prompt_ids)
        if request.lora:
            self._want(request)
        if num_prompt >= self.config.max_model_len:
            raise AdmissionError(
                f"prompt has {num_prompt} tokens; the model's context is "
                f"{self.config.max_model_len}"
            )
        capacity = min(num_prompt + params.max_tokens, self.config.max_model_len)
        if capacity > self.scheduler.max_tokens:
            raise AdmissionError(
                f"request needs up to {capacity} tokens of KV cache; this worker holds "
                f"{self.scheduler.max_tokens}"
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
        self.scheduler.add(
            Sequence(
                request=request,
                tokens=[*request.prompt_ids, *generated],
                capacity=capacity,
                generator=make_generator(params, self.runner.device),
                stop_ids=frozenset(stop),
                constraint=constraint,
            )
        )
        return None

    def _want(self, request: GenerateRequest) -> None:
        """Its adapter resident, or on its way (its request waits in the queue meanwhile)."""
        if self.config.loras is None:
            raise AdmissionError("this worker serves no LoRA adapter (batch-invariant)",
                                 "model_not_found")
        try:
            self.config.loras.want(request.lora, request.lora_path)
        except LoraError as e:
            raise AdmissionError(str(e), "model_not_found") from None

    def step(self) -> list[StepOutput]:
        failed = self._settle_loras()
        plan = self.scheduler.schedule()
        if not plan:
            if self.config.loras is not None and not failed:  # only adapters being read
                self.config.loras.wait(LORA_WAIT_S)
            return failed
        logits = self._run(plan)
        return failed + self._postprocess(plan, logits)

    def _settle_loras(self) -> list[StepOutput]:
        """Lay out the adapters read since the last step (worker/engine/lora/resident.py); a
        request waiting for one that failed its checks ends with the problem."""
        loras = self.config.loras
        if loras is None or not loras.loading:
            return []
        seqs = [*self.scheduler.running.values(), *self.scheduler.waiting]
        failed = loras.settle({s.request.lora for s in seqs if s.request.lora})
        outputs = []
        for seq in seqs:
            problem = failed.get(seq.request.lora)
            if problem is not None and self.scheduler.abort(seq.request.id):
                outputs.append(StepOutput(seq.request.id, seq.num_output, None, None,
                                          seq.num_prompt, seq.num_output,
                                          error=Error(problem, "invalid_request_error",
                                                      "invalid_lora_adapter")))
        return outputs

    def _run(self, plan: SchedulerOutput) -> torch.Tensor:
        """One forward pass over the plan's chunks: logits for `plan.sampled`, in order."""
        if self.threads is None:
            return self.runner.forward(plan.chunks)
        threads = self.threads.apply(plan.num_tokens)
        start = time.perf_counter()
        logits = self.runner.forward(plan.chunks)
        self.threads.record(plan.num_tokens, threads, time.perf_counter() - start)
        return logits

    def _postprocess(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[StepOutput]:
        """Record the plan's KV as computed, then sample a token for every request whose chunk
        reached its last token (and one after each of its drafts); a row whose sampling fails
        ends that request only."""
        self.scheduler.mark_computed(plan)
        sampled = plan.sampled
        rows: list[Row] = []
        starts: list[int] = []
        for item in sampled:
            starts.append(len(rows))
            rows += verify.rows(item.seq, item.drafts)
        self._mask(logits, sampled, starts)
        choices = sample(logits, rows, self.generator)
        outputs: list[StepOutput] = []
        for item, lo in zip(sampled, starts, strict=True):
            outputs += self._emit(item, choices[lo : lo + 1 + len(item.drafts)])
        return outputs

    def _mask(self, logits: torch.Tensor, sampled: list[Scheduled], starts: list[int]) -> None:
        """Grammars and `min_tokens`, on the rows that have them (a constrained request never
        drafts: its one row is at its start)."""
        suppress(logits, [(lo + j, it.seq.stop_ids) for it, lo in zip(sampled, starts, strict=True)
                          for j in range(len(it.drafts) + 1)
                          if it.seq.num_output + j < it.seq.request.params.min_tokens])
        if self.constraints is not None:
            self.constraints.apply(logits, [(lo, it.seq.constraint) for it, lo in
                                            zip(sampled, starts, strict=True)
                                            if it.seq.constraint is not None])

    def _emit(self, item: Scheduled, choices: list[Sampled]) -> list[StepOutput]:
        """`item`'s tokens of the step, in order: the drafts that stand and the token after
        them, up to a stop or the length limit. Its pages then count the drafts' KV."""
        seq, drafts = item.seq, item.drafts
        accepted = verify.accepted(choices, drafts)
        outputs: list[StepOutput] = []
        for choice in choices[: accepted + 1]:
            if isinstance(choice, SamplingError):
                if not outputs:  # else the drafts before it stand, and its row runs again
                    outputs.append(self._fail(seq, f"sampling failed: {choice}",
                                              "sampling_failed"))
                break
            outputs.append(self._append(seq, *choice))
            if outputs[-1].finish is not None or outputs[-1].error is not None:
                break
        if outputs[-1].finish is None and outputs[-1].error is None:
            self.scheduler.accept(seq, len(outputs) - 1)  # all but the last were drafts
        self.speculator.verified(seq, len(drafts), accepted, len(outputs))
        return outputs

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
            self.scheduler.finish(seq)
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
        self.scheduler.finish(seq)
        return StepOutput(seq.request.id, seq.num_output, None, None, seq.num_prompt,
                          seq.num_output, error=Error(message, "invalid_request_error", code))
