"""A bad constraint is a 400 naming its field (the OpenAI error's `param` too) before anything
reaches the queue: no request stream entry, no request hash. Each case would otherwise fail
later, at a worker, or end at once with an empty reply (a grammar no text satisfies)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.keys import Keys
from tests.stack import Stack

MODEL = "tiny-llama"
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture
def queue_probe(tiny_stack: Stack, client: openai.OpenAI,
                sync_redis: redis.Redis) -> Iterator[None]:
    """Asserts, after the test, that it put nothing on the request stream and made no request
    hash (XINFO's entries-added counts every XADD ever made to the stream)."""
    keys = Keys(tiny_stack.prefix)
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)  # the stream exists
    stream = keys.requests(MODEL)
    added = sync_redis.xinfo_stream(stream)["entries-added"]
    hashes = set(sync_redis.scan_iter(match=f"{keys.prefix}:{{*}}:*", count=1000, _type="hash"))
    yield
    assert sync_redis.xinfo_stream(stream)["entries-added"] == added
    now = set(sync_redis.scan_iter(match=f"{keys.prefix}:{{*}}:*", count=1000, _type="hash"))
    assert not now - hashes


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}


# (body fields, the param named, the error code)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("bad-type", _schema({"type": "objekt"}), "response_format", "invalid_grammar"),
    ("unsupported-keyword", _schema({"type": "array", "uniqueItems": True}),
     "response_format", "invalid_grammar"),
    ("guided-json-not", {"guided_json": {"not": {"type": "string"}}}, "guided_json",
     "invalid_grammar"),
    ("bad-regex", {"guided_regex": "[a-z"}, "guided_regex", "invalid_grammar"),
    # No text satisfies these: without the check each would end at once with an empty reply.
    ("ref-cycle", _schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                           "$ref": "#/$defs/a"}), "response_format", "invalid_grammar"),
    ("lark-cycle", {"guided_grammar": "start: a\na: b\nb: a"}, "guided_grammar",
     "invalid_grammar"),
    # The text it forces at the start already breaks the parser's limits (it nests itself).
    ("self-nesting", {"guided_json": {"type": "object", "properties": {"x": {"$ref": "#"}},
                                      "required": ["x"]}}, "guided_json", "invalid_grammar"),
    ("bad-so-regex", {"structured_outputs": {"regex": "("}}, "structured_outputs",
     "invalid_grammar"),
    ("bad-lark", {"guided_grammar": "start: ("}, "guided_grammar", "invalid_grammar"),
    ("bad-gbnf", {"guided_grammar": "root ::= [a"}, "guided_grammar", "invalid_grammar"),
    ("json-text-not-json", {"guided_json": "{not json"}, "guided_json", "invalid_grammar"),
    ("so-json-text-not-json", {"structured_outputs": {"json": "{not json"}},
     "structured_outputs", "invalid_grammar"),
    ("two-constraints", {"guided_regex": REGEX, "guided_choice": CHOICES}, "guided_choice",
     "invalid_value"),
    ("format-and-so", {"response_format": {"type": "json_object"},
                       "structured_outputs": {"regex": REGEX}}, "structured_outputs",
     "invalid_value"),
    ("so-two-at-once", {"structured_outputs": {"regex": REGEX, "choice": CHOICES}},
     "structured_outputs", "invalid_value"),
]


@pytest.mark.usefixtures("queue_probe")
@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize(("fields", "param", "code"), [r[1:] for r in REFUSED],
                         ids=[r[0] for r in REFUSED])
def test_bad_constraint_is_refused_before_queueing(tiny_stack: Stack, kind: str,
                                                   fields: dict[str, Any], param: str,
                                                   code: str) -> None:
    body = ({"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"})
    path = "chat/completions" if kind == "chat" else "completions"
    reply = httpx.post(f"{tiny_stack.base_url}/v1/{path}",
                       json={"model": MODEL, "max_tokens": 5, **body, **fields}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == code, error
    # Named in the message, and as the error's `param` (one of the fields when two clash).
    assert param in error["message"], error
    assert error["param"] is not None and error["param"] in fields, error
