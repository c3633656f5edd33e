"""Stored responses in Redis, bound to the tenant that made them: written once a reply ends
(with `store`), read by any replica for `GET /v1/responses/{id}`, its input items and a
follow-up's `previous_response_id`, deleted by `DELETE`. Each lives `response_ttl_s`.

Another tenant's response looks exactly like a missing one (404), as for cancel and resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis.asyncio as aioredis

from api.protocol.errors import APIError
from api.queue.context import AppContext
from api.render.responses import RESPONSE_PREFIX
from shared.keys import is_request_id
from shared.messages import StoredResponse, StoredResponseField

log = logging.getLogger("redserve.api")

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass(frozen=True)
class Stored:
    """A stored response, decoded."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up continues: this response's input, then its output, less the
        output text's logprobs (history has no use for them, and each follow-up stores its
        whole history again: with `top_logprobs` they would be most of it)."""
        return [*self.input_items, *map(_without_logprobs, self.response["output"])]


def _without_logprobs(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") != "message":
        return item
    return {**item, "content": [{**part, "logprobs": []} if "logprobs" in part else part
                                for part in item.get("content", ())]}


def request_id_of(response_id: str) -> str | None:
    """The request id inside `resp_<request id>`, or None for an id redserve never gave."""
    rest = response_id.removeprefix(RESPONSE_PREFIX)
    return rest if rest != response_id and is_request_id(rest) else None


async def save(ctx: AppContext, tenant: str, input_items: list[dict[str, Any]],
               response: dict[str, Any]) -> None:
    """Raises APIError 503 when Redis cannot take it: a client told `store` worked must be
    able to continue from it."""
    request_id = request_id_of(response["id"])
    assert request_id is not None
    record = StoredResponse(tenant, orjson.dumps(response).decode(),
                            orjson.dumps(input_items).decode())
    key = ctx.keys.response(request_id)
    pipe = ctx.clients.commands.pipeline(transaction=True)
    pipe.hset(key, mapping=record.to_fields())  # type: ignore[arg-type]
    pipe.expire(key, ctx.settings.response_ttl_s)
    try:
        await pipe.execute()
    except aioredis.RedisError as e:
        raise unavailable(e) from e


async def save_end(ctx: AppContext, tenant: str, input_items: list[dict[str, Any]],
                   response: dict[str, Any]) -> dict[str, Any] | None:
    """Store a background response's end unless it already has one or was deleted, in one
    optimistic transaction: the first end stored is the one every reader sees (a cancel's
    `cancelled` is not overwritten by the request's own end arriving later, a response deleted
    while it ran does not come back). Returns what is stored now (None: deleted)."""
    request_id = request_id_of(response["id"])
    assert request_id is not None
    key = ctx.keys.response(request_id)
    record = StoredResponse(tenant, orjson.dumps(response).decode(),
                            orjson.dumps(input_items).decode())

    async def write(pipe: Any) -> dict[str, Any] | None:
        raw = await pipe.hget(key, StoredResponseField.RESPONSE)
        stored = None if raw is None else orjson.loads(raw)
        if stored is None or stored["status"] in TERMINAL:
            return cast(dict[str, Any] | None, stored)
        pipe.multi()
        pipe.hset(key, mapping=record.to_fields())
        pipe.expire(key, ctx.settings.response_ttl_s)
        return response

    try:
        return cast(dict[str, Any] | None, await ctx.clients.commands.transaction(
            write, key, value_from_callable=True))
    except aioredis.RedisError as e:
        raise unavailable(e) from e


async def finish_background(ctx: AppContext, tenant: str, input_items: list[dict[str, Any]],
                            response: dict[str, Any]) -> None:
    """`save_end` as a reply's `finished` callback."""
    await save_end(ctx, tenant, input_items, response)


async def load(ctx: AppContext, response_id: str, tenant: str, param: str) -> Stored:
    """The tenant's stored response, or 404 naming `param`."""
    request_id = request_id_of(response_id)
    missing = APIError(404, f"Response with id {response_id[:140]!r} not found.", param=param,
                       code="not_found")
    if request_id is None:
        raise missing
    try:
        raw = cast(dict[bytes, bytes],
                   await ctx.clients.commands.hgetall(ctx.keys.response(request_id)))
    except aioredis.RedisError as e:
        raise unavailable(e) from e
    try:
        record = StoredResponse.decode(raw)
    except ValueError:  # none (expired or deleted), or not what redserve writes
        raise missing from None
    if record.tenant != tenant:
        raise missing
    return Stored(orjson.loads(record.response), orjson.loads(record.input_items))


async def delete(ctx: AppContext, response_id: str, tenant: str) -> None:
    await load(ctx, response_id, tenant, "response_id")
    request_id = request_id_of(response_id)
    assert request_id is not None
    try:
        await ctx.clients.commands.delete(ctx.keys.response(request_id))
    except aioredis.RedisError as e:
        raise unavailable(e) from e


def unavailable(e: Exception) -> APIError:
    log.warning("stored responses unavailable: %s", e)
    return APIError(503, "stored responses are unavailable; retry shortly", type="server_error",
                    code="redis_unavailable", headers={"Retry-After": "1"})
