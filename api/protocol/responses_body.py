"""The body of `POST /v1/responses`, checked as strictly as a chat body (`api.protocol.bodies`): an
unknown field is refused, and so is every field whose meaning redserve cannot honour (built-in
tools, images and files, reasoning effort, any `include` but the output text's logprobs), each
with a 400 naming the field, rather than answering as if it had been honoured.

What passes is turned into a chat body (`api.endpoints.responses.conversation`), so the Responses
API shares every check, limit and grammar the chat route has.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from api.protocol.bodies import JSONSchemaFormat
from api.protocol.errors import FieldError
from api.protocol.fields import (
    MAX_MESSAGES,
    MAX_METADATA,
    MAX_PARTS,
    MAX_TOOLS,
    Name,
    StrictModel,
    Text,
)

INPUT_ITEMS = ("message", "function_call", "function_call_output")
PARTS = ("input_text", "output_text")
MAX_ID_CHARS = 128
# The one `include` the engine serves: each output text token's logprobs (`top_logprobs`
# alternatives each). Without it OpenAI returns none, `top_logprobs` or not; so does redserve.
LOGPROBS = "message.output_text.logprobs"


class InputText(StrictModel):
    type: Literal["input_text"]
    text: Text


class OutputText(StrictModel):
    """A part of an earlier answer fed back (as the client's `response.output` holds it)."""

    type: Literal["output_text"]
    text: Text
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: list[Any] | None = None


Part = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")],
    Discriminator("type"),
]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[Part], Field(max_length=MAX_PARTS)]
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Text  # JSON text
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text | Annotated[list[InputText], Field(max_length=MAX_PARTS)]
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(
            p.text for p in self.output)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(
        value, "type", "message")
    return str(kind)


# Tagged by `type` (a message may leave it out); the tags are the types, checked beforehand
# (`ResponsesRequest._supported_input`), so a tag never fails to match.
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True  # OpenAI's default for a function tool of the Responses API


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: Name


class TextFormat(StrictModel):
    """`text.format`: OpenAI's flattened json_schema (`name`, `schema`, `strict` beside
    `type`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> Any:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise FieldError("text.format", "a json_schema format needs a name and a schema")
        if self.type != "json_schema" and (self.name or self.json_schema or self.strict):
            raise FieldError("text.format", "name, schema and strict go with type "
                             "'json_schema' only")
        return self

    def as_chat(self) -> dict[str, Any] | None:
        """The chat body's `response_format`, or None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = JSONSchemaFormat(name=self.name or "", description=self.description,
                                  schema=self.json_schema, strict=bool(self.strict))
        return {"type": "json_schema",
                "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(StrictModel):
    format: TextFormat = TextFormat(type="text")


class Reasoning(StrictModel):
    """Accepted empty only: redserve serves no reasoning model whose effort it could set."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @model_validator(mode="after")
    def _nothing_asked(self) -> Any:
        for name in ("effort", "summary", "generate_summary"):
            if getattr(self, name) is not None:
                raise FieldError(f"reasoning.{name}", f"reasoning.{name} is not supported: "
                                 "the model served has no reasoning settings")
        return self


class StreamOptions(StrictModel):
    include_obfuscation: bool = False  # OpenAI's padding against side channels: none here


class ResponsesRequest(StrictModel):
    model: Name
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    user: Name | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: Reasoning | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    background: bool = False
    # OpenAI's fields that change nothing in the output: checked, then unused.
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _supported_input(cls, value: Any) -> Any:
        """Items and parts of a type redserve does not take (images, files, audio, reasoning,
        item references, built-in tool calls) are refused by name."""
        for i, item in enumerate(value if isinstance(value, list) else ()):
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind not in INPUT_ITEMS:
                raise FieldError(f"input[{i}].type", f"input item type {str(kind)[:64]!r} is "
                                 f"not supported: only {', '.join(INPUT_ITEMS)}")
            content = item.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in PARTS:
                    raise FieldError(f"input[{i}].content[{j}].type", f"content part type "
                                     f"{str(ptype)[:64]!r} is not supported (images, files and "
                                     f"audio are not): only {', '.join(PARTS)}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise FieldError(f"tools[{i}].type", f"tool type {str(kind)[:64]!r} is not "
                                 "supported: only function tools are (built-in tools such as "
                                 "web search, file search and computer use are not)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise FieldError("tool_choice", f"tool_choice type {str(value.get('type'))[:64]!r} "
                             "is not supported: only 'function' (with its name)")
        return value

    @model_validator(mode="after")
    def _nothing_unhonoured(self) -> Any:
        for value in self.include or ():
            if value != LOGPROBS:
                raise FieldError("include", f"include {value[:64]!r} is not supported: only "
                                 f"{LOGPROBS!r} is served")
        if self.background and not self.store:
            raise FieldError("store", "background responses must be stored: leave store "
                             "true, or background false")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> Any:
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError("tools", "two functions share a name")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        if isinstance(choice, FunctionChoice) and choice.name not in names:
            raise FieldError("tool_choice", f"tool_choice names function {choice.name!r}, "
                             "which is not among the tools")
        return self

    def logprobs(self) -> int | None:
        """None: no logprobs asked for (`include`); N: each token's and N alternatives'."""
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def echo_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        return choice if isinstance(choice, str) else choice.model_dump()
