"""The worker's Redis writes and abort reads.

Everything a step produces (tokens, terminal entries, state changes, XACKs) is staged, then
`flush` sends it in one pipeline; `aborted` reads every running request's abort key in one
more (see `worker.service` for when each runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import redis.asyncio as aioredis

from shared.keys import WORKER_GROUP, Keys
from shared.messages import Error, Finish, GenerateRequest, RequestState, Tokens
from shared.settings import Settings
from worker.engine import StepOutput

_FINAL_STATE = {
    "stop": RequestState.DONE,
    "length": RequestState.DONE,
    "abort": RequestState.ABORTED,
}


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        on_end: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.redis = redis
        self.on_end = on_end
        self.keys = keys
        self.settings = settings
        # request id -> its entry id in the request stream, XACKed once the request ends.
        self.entry_ids: dict[str, str] = {}
        # Requests whose result stream exists already (and so carries its TTL).
        self._streams: set[str] = set()
        self._pipe = redis.pipeline(transaction=False)

    def take(self, request: GenerateRequest, entry_id: str) -> None:
        """A request read from the stream: remember its entry, free its queue slot."""
        self.entry_ids[request.id] = entry_id
        self._pipe.zrem(self.keys.queued(request.model), request.queue_member)

    def stage_ack(self, request_id: str) -> None:
        """Acknowledge a request that already ended elsewhere (its terminal entry exists)."""
        entry_id = self.entry_ids.pop(request_id)
        self._pipe.xack(self.keys.requests, WORKER_GROUP, entry_id)

    def stage_hand_back(self, request: GenerateRequest) -> None:
        """Return a request no step has touched to the stream, for another worker."""
        entry_id = self.entry_ids.pop(request.id)
        self._pipe.xadd(self.keys.requests, request.to_fields(),  # type: ignore[arg-type]
                        maxlen=self.settings.request_stream_maxlen, approximate=True)
        self._pipe.xack(self.keys.requests, WORKER_GROUP, entry_id)
        self._pipe.hset(self.keys.state(request.id), "state", RequestState.QUEUED)

    def stage(self, outputs: Iterable[StepOutput]) -> None:
        for out in outputs:
            if out.error is not None:
                self.stage_error(out.request_id, Error(
                    f"sampling failed: {out.error}", "invalid_request_error", "sampling_failed"))
            if out.token is not None:
                logprobs = (out.logprob,) if out.logprob is not None else None
                self._xadd(out.request_id, Tokens(out.index, (out.token,), logprobs).to_fields())
            if out.finish is not None:
                finish = Finish(out.finish, out.prompt_tokens, out.completion_tokens,
                                out.cached_tokens)
                self._end(out.request_id, finish.to_fields(), _FINAL_STATE[out.finish],
                          {"completion_tokens": str(out.completion_tokens)})

    def stage_error(self, request_id: str, error: Error) -> None:
        self._end(request_id, error.to_fields(), RequestState.ERROR, {})

    def stage_running(self, request_id: str, worker: str) -> None:
        state_key = self.keys.state(request_id)
        self._pipe.hset(state_key, mapping={"state": RequestState.RUNNING, "worker": worker})
        self._pipe.expire(state_key, self.settings.request_ttl_s)

    def discard_staged(self) -> None:
        """Forget what a failed pipeline held (Redis went away)."""
        self._pipe = self.redis.pipeline(transaction=False)
        self._streams.clear()

    async def flush(self) -> None:
        """Send what is staged, in one pipeline."""
        pipe, self._pipe = self._pipe, self.redis.pipeline(transaction=False)
        if len(pipe):
            await pipe.execute()

    async def aborted(self, request_ids: Iterable[str]) -> set[str]:
        """Which of these requests have their abort key set (one pipeline)."""
        watched = list(request_ids)
        if not watched:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for request_id in watched:
            pipe.exists(self.keys.abort(request_id))
        flags = await pipe.execute()
        return {rid for rid, flag in zip(watched, flags, strict=True) if flag}

    def _xadd(self, request_id: str, fields: dict[str, str]) -> None:
        out_key = self.keys.out(request_id)
        self._pipe.xadd(out_key, fields)  # type: ignore[arg-type]
        if request_id not in self._streams:
            self._streams.add(request_id)
            self._pipe.expire(out_key, self.settings.request_ttl_s)

    def _end(self, request_id: str, fields: dict[str, str], state: str,
             extra: dict[str, str]) -> None:
        self.on_end(fields.get("finish_reason") or fields["code"])
        self._xadd(request_id, fields)
        self._streams.discard(request_id)
        ttl = self.settings.finished_ttl_s
        self._pipe.expire(self.keys.out(request_id), ttl)
        mapping = {"state": state, **extra}
        if "finish_reason" in fields:
            mapping["finish_reason"] = fields["finish_reason"]
        state_key = self.keys.state(request_id)
        self._pipe.hset(state_key, mapping=mapping)  # type: ignore[arg-type]
        self._pipe.expire(state_key, ttl)
        entry_id = self.entry_ids.pop(request_id, None)
        if entry_id is not None:
            self._pipe.xack(self.keys.requests, WORKER_GROUP, entry_id)
