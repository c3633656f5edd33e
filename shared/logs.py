"""Structured log events: one call site, rendered as JSON lines or as text.

A request's story (accepted, admitted, finished, with its timings) is what operators search
logs for, so it goes out as named fields, not as prose: `log_event(log, "request.finished",
request_id=..., ttft_s=...)`. The fields ride on the record as `record.fields`; the handler
that `setup_logging` installs renders them (a JSON object a line, or `key=value` after the
message).

`setup_logging` gives the root logger the one handler, and Python's warnings go to it too;
uvicorn is started without a logging configuration of its own (see api/server.py), so its
loggers reach it as well and a log collector reading `--log-format json` never meets a line
that is not JSON. A value that JSON cannot hold is written as its `str()`: a log call never
fails because of what it carries.

Prompt and output text stay out of the logs unless the operator asked for them
(`REDSERVE_LOG_REQUEST_TEXT`): they may only travel in the fields named in
`REQUEST_TEXT_FIELDS`, which the handler drops otherwise, so the decision is made here once
rather than at every call site.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, TextIO

import orjson
from rich.console import Console
from rich.logging import RichHandler

from shared.settings import Settings

# The only fields that may hold request or reply text: dropped unless `log_request_text`.
REQUEST_TEXT_FIELDS = frozenset({"prompt", "messages", "output", "text", "body"})
# Libraries that log request or reply text at DEBUG (sse-starlette: every SSE chunk); kept at
# INFO unless `log_request_text`.
_TEXT_AT_DEBUG = ("sse_starlette",)
# Values that read unambiguously without quotes in `key=value`.
_BARE = re.compile(r"^[\w.:/@+-]+$")


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO,
              **fields: Any) -> None:
    """Log `event` with `fields` (JSON-serializable values) as structured data."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": {"event": event, **fields}})


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


def _safe_str(value: object) -> str:
    try:
        text = str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"
    # Lone surrogates cannot be UTF-8; keep them visible instead.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` as JSON types only, for what orjson refused (huge ints, surrogates, cycles)."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if depth < 8 and isinstance(value, dict):
        return {_safe_str(k): _plain(v, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, list | tuple | set | frozenset):
        return [_plain(v, depth + 1) for v in value]
    return _safe_str(value)


def dumps(value: Any) -> bytes:
    """`value` as JSON, with whatever JSON cannot hold as its `str()`; never raises."""
    try:
        return orjson.dumps(value, default=_safe_str, option=orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return orjson.dumps(_plain(value))


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # arguments that do not fit the format: keep both
        return f"{_safe_str(record.msg)} {_safe_str(record.args)}"


class JSONFormatter(logging.Formatter):
    """One JSON object a line: ts (ISO 8601, UTC), level, logger, msg, pid, the record's
    fields, and exc/stack when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": _message(record),
            "pid": record.process,
        }
        for key, value in _fields(record).items():
            line.setdefault(key, value)  # a field cannot overwrite the record's own keys
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return dumps(line).decode()


def _value(value: Any) -> str:
    if isinstance(value, str) and _BARE.match(value):
        return value
    return dumps(value).decode()


class TextFormatter(logging.Formatter):
    """The message, then each field as `key=value` (the event's name is the message)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        pairs = " ".join(f"{k}={_value(v)}" for k, v in fields.items()
                         if not (k == "event" and v == record.msg))
        line = super().formatMessage(record)
        return f"{line} {pairs}" if pairs else line


class _DropRequestText(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        fields = _fields(record)
        if REQUEST_TEXT_FIELDS.intersection(fields):
            record.fields = {k: v for k, v in fields.items() if k not in REQUEST_TEXT_FIELDS}
        return True


def _utc_text_formatter() -> TextFormatter:
    formatter = TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    formatter.converter = time.gmtime
    formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
    formatter.default_msec_format = "%s.%03dZ"
    return formatter


def make_handler(settings: Settings, stream: TextIO | None = None) -> logging.Handler:
    """The handler for `settings.log_format`: JSON lines; on a terminal rich's columns; else
    plain text lines that nothing wraps."""
    stream = stream or sys.stderr
    handler: logging.Handler
    if settings.log_format == "json":
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JSONFormatter())
    elif stream.isatty():
        handler = RichHandler(console=Console(file=stream), show_path=False)
        handler.setFormatter(TextFormatter("%(message)s"))
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(_utc_text_formatter())
    if not settings.log_request_text:
        handler.addFilter(_DropRequestText())
    return handler


def setup_logging(settings: Settings, stream: TextIO | None = None,
                  loads_models: bool = False) -> None:
    """Send every logger of this process through one handler at `settings.log_level`.

    `loads_models`: the process may import transformers (to load or convert a model), whose
    logger has a handler of its own and does not propagate, and whose progress bars write
    to stderr; both are taken over once it is imported (the import costs a second, so it is
    never made here).
    """
    stream = stream or sys.stderr
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(make_handler(settings, stream))
    root.setLevel(settings.log_level.upper())
    # httpx logs every request it sends at INFO (the supervisor's probes).
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
    if not settings.log_request_text:
        for name in _TEXT_AT_DEBUG:
            logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    logging.captureWarnings(True)
    if loads_models:
        bars = not (settings.log_format == "json" or not stream.isatty())
        if "transformers" in sys.modules:
            _adopt_transformers(bars)
        else:  # a worker of a checkpoint that needs none of it never imports it
            sys.meta_path.insert(0, _OnImport("transformers", lambda: _adopt_transformers(bars)))


def _adopt_transformers(progress_bars: bool) -> None:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    # A bar redrawn with carriage returns is noise anywhere but a terminal.
    if not progress_bars:
        transformers_logging.disable_progress_bar()


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs `then` right after the first import of the package `name`, whoever imports it:
    its logging is taken over where it is imported, at no cost where it never is."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; the search below is the import system's own
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface
        return getattr(self.loader, name)
