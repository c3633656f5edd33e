"""Continuous batching: requests join and leave between steps; each step is one forward pass
over every running request's next token plus the prompts admitted this step.

Not thread-safe by design: the worker service calls `add`/`abort` only between steps, while
`step` runs on the compute thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from shared.messages import FinishReason, GenerateRequest, TokenLogprob
from worker.kv_cache import KVBudget, RequestKV
from worker.model_runner import ModelRunner, Segment
from worker.sampler import Row, make_generator, sample


class AdmissionError(ValueError):
    """The request can never run on this worker."""


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    tokens: list[int]
    capacity: int  # prompt + completion tokens this request may hold
    generator: torch.Generator | None
    kv: RequestKV | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)

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


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: tuple[int, ...],
        max_running: int,
        max_prefill_tokens: int,
        kv_cache_bytes: int,
        max_model_len: int,
    ) -> None:
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.kv = KVBudget(runner.kv_shape, kv_cache_bytes)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> list[str]:
        return [*self.running, *(s.request.id for s in self.waiting)]

    def find(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.request.id == request_id), None)
        return seq

    def add(self, request: GenerateRequest) -> None:
        params = request.params
        capacity = min(len(request.prompt_ids) + params.max_tokens, self.max_model_len)
        if len(request.prompt_ids) >= self.max_model_len:
            raise AdmissionError(
                f"prompt has {len(request.prompt_ids)} tokens; the model's context is "
                f"{self.max_model_len}"
            )
        if capacity > self.kv.total_tokens:
            raise AdmissionError(
                f"request needs {capacity} tokens of KV cache; this worker holds "
                f"{self.kv.total_tokens}"
            )
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        self.waiting.append(
            Sequence(
                request=request,
                tokens=list(request.prompt_ids),
                capacity=capacity,
                generator=make_generator(params, self.runner.device),
                stop_ids=frozenset(stop),
            )
        )

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV now. True if it was here."""
        seq = self.running.pop(request_id, None)
        if seq is None:
            for i, waiting in enumerate(self.waiting):
                if waiting.request.id == request_id:
                    del self.waiting[i]
                    return True
            return False
        self._release(seq)
        return True

    def drop_running(self) -> list[Sequence]:
        """Remove every running request (after a failed step) and free its KV."""
        dropped = list(self.running.values())
        for seq in dropped:
            self._release(seq)
        self.running.clear()
        return dropped

    def drop_waiting(self) -> list[Sequence]:
        dropped = list(self.waiting)
        self.waiting.clear()
        return dropped

    def step(self) -> list[StepOutput]:
        prefill = self._admit()
        fresh = {id(s) for s in prefill}
        decode = [s for s in self.running.values() if id(s) not in fresh]
        batch = prefill + decode
        if not batch:
            return []
        token_ids: list[int] = []
        segments: list[Segment] = []
        for seq in prefill:
            assert seq.kv is not None
            token_ids.extend(seq.tokens)
            segments.append(Segment(seq.kv, 0, len(seq.tokens)))
        for seq in decode:
            assert seq.kv is not None
            token_ids.append(seq.tokens[-1])
            segments.append(Segment(seq.kv, len(seq.tokens) - 1, 1))

        logits = self.runner.forward(token_ids, segments)
        rows = [Row(s.request.params, s.generator, s.tokens, s.num_prompt) for s in batch]
        chosen = sample(logits, rows)
        return [self._append(seq, token, logprob)
                for seq, (token, logprob) in zip(batch, chosen, strict=True)]

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        prefill_tokens = 0
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if admitted and prefill_tokens + len(seq.tokens) > self.max_prefill_tokens:
                break
            kv = self.kv.try_allocate(seq.capacity)
            if kv is None:
                break  # wait for running requests to finish and free their KV
            seq.kv = kv
            self.waiting.popleft()
            self.running[seq.request.id] = seq
            admitted.append(seq)
            prefill_tokens += len(seq.tokens)
        return admitted

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> StepOutput:
        seq.tokens.append(token)
        index = seq.num_output - 1
        finish: FinishReason | None = None
        shown: int | None = token
        if token in seq.stop_ids:
            finish, shown = "stop", None
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
        )

    def _release(self, seq: Sequence) -> None:
        if seq.kv is not None:
            self.kv.release(seq.kv)
            seq.kv = None
