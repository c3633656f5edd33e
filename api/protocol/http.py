"""A JSON body as an HTTP response, serialized by orjson: every JSON answer of the replica
(replies, errors, status) goes out through it."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(
    body: dict[str, Any], status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(body), status_code, headers, media_type="application/json")
