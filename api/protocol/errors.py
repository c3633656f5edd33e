"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}.

Every failure a client can see has this shape, an unexpected exception included (500, its
text only in the log: exception texts name hosts, files and internals).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from api.protocol.http import json_response
from shared.messages import Error

log = logging.getLogger("redserve.api")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# A replica that stops past its drain grace ends what it still serves with one of these.
SHUTDOWN_ERROR = Error("the server is shutting down", "server_error", "server_shutdown")
MOVED_CODE = "replica_shutdown"


def moved(request_id: str) -> Error:
    """The end of a stream whose replica stops while its request goes on (the worker is not
    told): the client resumes it on any replica, from the last event it received."""
    return Error(f"this replica is shutting down and request {request_id} goes on: resume its "
                 f"stream on any replica with GET /v1/requests/{request_id}/stream and the "
                 "Last-Event-ID header (the id of the last event received)", "server_error",
                 MOVED_CODE)


# Codes for the errors Starlette raises itself (unknown path, wrong method, unreadable body).
_HTTP_CODES = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed"}

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class FieldError(ValueError):
    """A body check that spans several fields, naming the one a client should change."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _param(loc: tuple[Any, ...]) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"; pydantic's union-member tags
    # ("str", "list[str]", "function-after[...]") are not part of the field's path.
    out = ""
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in _TYPE_TAGS or "[" in str(p) or "-" in str(p):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out or None


def _most_telling(errors: Sequence[Any]) -> Any:
    """Of a union's errors, the one that is not a mere type mismatch with another member."""
    for error in errors:
        if not str(error.get("type", "")).endswith("_type"):
            return error
    return errors[0]


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return json_response(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        first = _most_telling(exc.errors()) if exc.errors() else {"loc": (), "msg": "invalid"}
        param = _param(tuple(first.get("loc", ())))
        ctx = first.get("ctx")
        cause = ctx.get("error") if isinstance(ctx, dict) else None
        if isinstance(cause, FieldError):  # a check across fields names the one at fault
            param = cause.param
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "value_error" and cause is not None:
            message = str(cause)  # the check's own words, without pydantic's "Value error, "
        elif first.get("type") == "extra_forbidden":
            message = "this field is not supported by redserve"
        elif first.get("type") == "json_invalid":
            param, message = None, "the request body is not valid JSON"
        if param:
            message = f"{param}: {message}"
        return json_response(
            error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method,
                  request.url.path, exc_info=exc)
        return json_response(error_body("internal server error", "server_error", None,
                                        "internal_error"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return json_response(
            error_body(str(exc.detail), kind, None, code), status_code=exc.status_code,
            headers=dict(exc.headers) if exc.headers else None,
        )
