"""Which renderer a chat or completions `ReplySpec` is rendered with: the chunks driver
(`api.render.chunks`) with the format's shapes (`api.render.chat`, `api.render.completions`).
The live reply and its resumed stream pick it here alike (`api.endpoints.serving`)."""

from __future__ import annotations

from api.protocol.reply_spec import Kind, ReplySpec
from api.render.chat import ChatShape
from api.render.choices import Choice
from api.render.chunks import ChoicesRenderer
from api.render.completions import CompletionsShape

SHAPES: dict[Kind, type[ChatShape] | type[CompletionsShape]] = {
    "chat": ChatShape, "completions": CompletionsShape}


def renderer(choices: list[Choice], spec: ReplySpec, whole: bool) -> ChoicesRenderer:
    """`whole`: the reply is one JSON object (a stream keeps none of its output)."""
    return ChoicesRenderer(choices, spec, whole, SHAPES[spec.kind](choices))


def reply_id(spec: ReplySpec) -> str:
    """The `id` of the reply's objects (`chatcmpl-…`, `cmpl-…`)."""
    return f"{SHAPES[spec.kind].ID_PREFIX}-{spec.base_id}"
