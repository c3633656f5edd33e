"""The parts request bodies are built of: the strict base model they share, bounded text and
token ids, the chat messages (tagged by role) and the tool definitions, with the limits that
bound each of them (`api.protocol.bodies` assembles the bodies).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

MAX_N = 16
MAX_CHOICES = 128  # prompts x n in one request: each is a queued request of its own
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_PARTS = 256  # content parts of one message
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_NAME_CHARS = 256  # model, user, message name
TOKEN_ID_DIGITS = 10
INT64 = 2**63
# vLLM's `priority` (lower runs first): any whole number in +-this (carried in the queue's
# member, see shared/messages/queue.py).
MAX_PRIORITY = 1_000_000
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
MAX_GUIDED_CHOICES = 1024
MAX_METADATA = 16  # OpenAI's own limit on `metadata` pairs


class StrictModel(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused like any bad number,
    # and so are values of the wrong JSON type ("4" or true for an integer, 4.0 for a token id).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's API takes `null` for "use the default" on every optional field, and
        # clients send it so.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _valid_unicode(text: str) -> str:
    # JSON's \ud800-style escapes can carry lone surrogates, which no tokenizer accepts.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (not valid Unicode)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class FunctionCall(StrictModel):
    name: Name
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(StrictModel):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


Content = Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)]


class _Message(StrictModel):
    name: Name | None = None

    def text(self) -> str:
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(part.text for part in content)


class PromptMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: Content


class AssistantMessage(_Message):
    # The rule `_says_or_calls` keeps, in the published schema too: a client (or fuzzer) that
    # writes bodies from /openapi.json then writes assistant turns this API takes.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                   "minItems": 1}}}]})
    role: Literal["assistant"]
    content: Content | None = None  # none when the turn only called tools
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None

    @model_validator(mode="after")
    def _says_or_calls(self) -> Any:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: Name  # the call it answers


_KINDS = {"system": "prompt-message", "developer": "prompt-message", "user": "prompt-message",
          "assistant": "assistant-message", "tool": "tool-message"}


def _message_kind(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return _KINDS.get(role) if isinstance(role, str) else None


# Tagged by role; the tags hold a "-" so error paths leave them out (`api.protocol.errors`).
ChatMessage = Annotated[
    Annotated[PromptMessage, Tag("prompt-message")]
    | Annotated[AssistantMessage, Tag("assistant-message")]
    | Annotated[ToolMessage, Tag("tool-message")],
    Discriminator(_message_kind, custom_error_type="invalid_role",
                  custom_error_message=f"role must be one of {', '.join(_KINDS)}"),
]


class FunctionDef(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False

    @model_validator(mode="after")
    def _parameters_are_an_object(self) -> Any:
        kind = (self.parameters or {}).get("type", "object")
        if kind != "object":  # the arguments are one JSON object, whatever the function
            raise ValueError(f"parameters must be a JSON schema of an object, not of {kind!r}")
        return self


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: Name


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
