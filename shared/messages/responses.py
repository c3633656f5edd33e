"""A stored Responses API reply (`/v1/responses` with `store`): one hash per response, read
back by any replica for `GET /v1/responses/{id}`, its input items, and a follow-up's
`previous_response_id`, so a conversation lives in Redis and never in one replica.

Each response stores its whole conversation so far (every earlier turn's input and output
items, then its own input), not a link to the previous response: a follow-up rebuilds its
prompt with one read, and an earlier response expiring or being deleted does not break the
responses after it. The cost is memory: a chain of k turns stores its first turn k times
(docs/operations.md states it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from shared.messages.state import as_text


class StoredResponseField(StrEnum):
    """The fields of a stored response's hash (`shared.keys`: `{prefix}:{<replica>}:<id>:response`).
    JSON text in flat fields, so `redis-cli HGETALL` reads it."""

    TENANT = "tenant"  # whose it is: only that tenant may read, chain or delete it
    RESPONSE = "response"  # the Response object as `GET /v1/responses/{id}` returns it (JSON)
    INPUT = "input"  # the conversation's input items, oldest first, each with its id (JSON)


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    response: str  # JSON object
    input_items: str  # JSON array: earlier turns' input and output items, then this input

    def to_fields(self) -> dict[str, str]:
        return {str(StoredResponseField.TENANT): self.tenant,
                str(StoredResponseField.RESPONSE): self.response,
                str(StoredResponseField.INPUT): self.input_items}

    @classmethod
    def decode(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> StoredResponse:
        """From an HGETALL reply; ValueError for a hash that is missing (expired) or not one
        redserve writes."""
        f = {as_text(k): as_text(v) for k, v in raw.items()}
        try:
            return cls(f[StoredResponseField.TENANT], f[StoredResponseField.RESPONSE],
                       f[StoredResponseField.INPUT])
        except KeyError as e:
            raise ValueError(f"no {e.args[0]!s} field") from None


@dataclass(frozen=True)
class ResponsesStream:
    """What a replay of a `/v1/responses` stream needs beside chat's, kept in its request's
    `StreamView` (`responses`): the request body (its `input` left empty) to render the
    events again, and the conversation's input items to store the response under."""

    body: dict[str, Any]
    items: list[dict[str, Any]]

    def to_json(self) -> str:
        return orjson.dumps({"body": self.body, "items": self.items}).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> ResponsesStream:
        fields = orjson.loads(raw)
        return cls(fields["body"], fields["items"])
