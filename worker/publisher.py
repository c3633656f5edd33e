"""The per-step Redis round trip: publish every step's tokens and terminal entries and read
every running request's abort key, all in one pipeline."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis

from shared.keys import WORKER_GROUP, Keys
from shared.messages import Error, Finish, RequestState, Tokens
from shared.settings import Settings
from worker.engine import StepOutput

_FINAL_STATE = {
    "stop": RequestState.DONE,
    "length": RequestState.DONE,
    "abort": RequestState.ABORTED,
}


class Publisher:
    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        # request id -> its entry id in the request stream, XACKed once the request ends.
        self.entry_ids: dict[str, str] = {}
        # Requests whose result stream exists already (and so carries its TTL).
        self._streams: set[str] = set()

    def track(self, request_id: str, entry_id: str) -> None:
        self.entry_ids[request_id] = entry_id

    async def publish(
        self,
        outputs: Sequence[StepOutput],
        errors: Sequence[tuple[str, Error]] = (),
        check_aborts: Iterable[str] = (),
    ) -> set[str]:
        """Publish, end requests, and return which of `check_aborts` have their abort key set."""
        pipe = self.redis.pipeline(transaction=False)
        for out in outputs:
            if out.token is not None:
                self._xadd(pipe, out.request_id, Tokens(out.index, (out.token,)).to_fields())
            if out.finish is not None:
                finish = Finish(out.finish, out.prompt_tokens, out.completion_tokens)
                self._end(pipe, out.request_id, finish.to_fields(), _FINAL_STATE[out.finish],
                          out.completion_tokens)
        for request_id, error in errors:
            self._end(pipe, request_id, error.to_fields(), RequestState.ERROR, None)
        watched = list(check_aborts)
        for request_id in watched:
            pipe.exists(self.keys.abort(request_id))
        if not len(pipe):
            return set()
        results = await pipe.execute()
        flags = results[len(results) - len(watched):] if watched else []
        return {rid for rid, flag in zip(watched, flags, strict=True) if flag}

    def _xadd(
        self, pipe: aioredis.client.Pipeline, request_id: str, fields: dict[str, str]
    ) -> None:
        out_key = self.keys.out(request_id)
        pipe.xadd(out_key, fields)  # type: ignore[arg-type]
        if request_id not in self._streams:
            self._streams.add(request_id)
            pipe.expire(out_key, self.settings.request_ttl_s)

    def _end(
        self,
        pipe: aioredis.client.Pipeline,
        request_id: str,
        fields: dict[str, str],
        state: str,
        completion_tokens: int | None,
    ) -> None:
        self._xadd(pipe, request_id, fields)
        ttl = self.settings.finished_ttl_s
        pipe.expire(self.keys.out(request_id), ttl)
        mapping = {"state": state}
        if "finish_reason" in fields:
            mapping["finish_reason"] = fields["finish_reason"]
        if completion_tokens is not None:
            mapping["completion_tokens"] = str(completion_tokens)
        state_key = self.keys.state(request_id)
        pipe.hset(state_key, mapping=mapping)  # type: ignore[arg-type]
        pipe.expire(state_key, ttl)
        entry_id = self.entry_ids.pop(request_id, None)
        if entry_id is not None:
            pipe.xack(self.keys.requests, WORKER_GROUP, entry_id)
        self._streams.discard(request_id)
