"""The bodies of vLLM's `/tokenize` and `/detokenize` (`api.endpoints.tokenize`), with vLLM's
fields and defaults: a chat body is tokenized as `/v1/chat/completions` would
(`api.endpoints.serving.chat_prompt_ids`), so it sits here, below both endpoints."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, model_validator

from api.protocol.errors import FieldError
from api.protocol.fields import (
    INT64,
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatMessage,
    Name,
    StrictModel,
    Text,
    Tool,
    ToolChoice,
)

# A token id as vLLM bounds it (a signed 64-bit integer); the vocabulary is checked per model.
TokenId = Annotated[int, Field(ge=0, lt=INT64)]


class TokenizeCompletionRequest(StrictModel):
    model: Name | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    model: Name | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template places the special tokens itself.
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=16)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    # Beyond vLLM's body: "none" leaves the tools out, as a chat completion does, so the count
    # is the one that chat completion would use.
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _one_way_to_end(self) -> Any:
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message and "
                             "add_generation_prompt cannot both be true")
        return self


def _body_kind(data: Any) -> str:
    # vLLM takes either body on one path; `messages` tells them apart. The tags hold a "-", so
    # an error's `param` names the field alone (see `api.protocol.errors`), not the tag.
    chat = isinstance(data, dict) and data.get("messages") is not None
    return "chat-body" if chat else "completion-body"


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("chat-body")]
    | Annotated[TokenizeCompletionRequest, Tag("completion-body")],
    Discriminator(_body_kind),
]


class DetokenizeRequest(StrictModel):
    model: Name | None = None
    tokens: list[TokenId]
