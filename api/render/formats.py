"""Which renderer a chat or completions `ReplySpec` is rendered with: the live reply and its
resumed stream pick it here alike (`api.endpoints.serving`)."""

from __future__ import annotations

from api.protocol.reply_spec import Kind, ReplySpec
from api.render.chat import ChatRenderer
from api.render.choices import Choice
from api.render.chunks import ChoicesRenderer
from api.render.completions import CompletionsRenderer

RENDERERS: dict[Kind, type[ChoicesRenderer]] = {"chat": ChatRenderer,
                                                "text": CompletionsRenderer}


def renderer(choices: list[Choice], spec: ReplySpec, whole: bool) -> ChoicesRenderer:
    """`whole`: the reply is one JSON object (a stream keeps none of its output)."""
    return RENDERERS[spec.kind](choices, spec, whole)


def reply_id(spec: ReplySpec) -> str:
    """The `id` of the reply's objects (`chatcmpl-…`, `cmpl-…`)."""
    return f"{RENDERERS[spec.kind].ID_PREFIX}-{spec.base_id}"
