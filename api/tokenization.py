"""vLLM's `/tokenize` and `/detokenize`: the token ids a prompt becomes, and the text token
ids stand for, answered by the replica alone, with no worker and no Redis.

Clients call them to count a prompt against the context before sending it, to build prompts
as token ids, and to read back ids they hold. A count is only useful if it is the count the
generation routes would reach, so the same tokenizer does the work, and a chat body is
rendered exactly as `/v1/chat/completions` renders it (`api.tools.prompt.conversation`, then
`TextCodec.encode_turns`): tools taught in the system message for a template without a tool
format of its own are counted too. `count` is then the `prompt_tokens` of that chat request.

The paths, fields, defaults and reply are vLLM's (`TokenizeCompletionRequest`,
`TokenizeChatRequest`, `DetokenizeRequest`, `TokenizeResponse`): `model` may be left out when
the replica serves one model, `token_strs` are the vocabulary's own pieces
(`convert_ids_to_tokens`), and detokenized text keeps special tokens. As everywhere in
redserve, and unlike vLLM, an unknown field is refused (400 naming it), so `chat_template`
(which vLLM also refuses by default) and the multimodal kwargs are refused here.

The paths sit at the root, as vLLM's do, outside `/v1/`: `api.auth.guard` lists them, so a
stranger is refused and the body bounded before any tokenizer time is spent. Inputs are
bounded by the model's context: more token ids than the context holds are refused, and so is
text that surely cannot fit (`TextCodec.surely_too_long`); text somewhat past the context is
still counted, so a client learns by how much its prompt is too long. Tokenizing and decoding
run in the thread pool, never on the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Discriminator, Field, Tag, model_validator
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedTokenizerBase

from api.context import AppContext, ServedModel
from api.errors import APIError, FieldError
from api.fields import (
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
from api.protocol import ChatCompletionRequest
from api.render.http import json_response
from api.text import ChatOptions, TemplateRefused
from api.tools.prompt import conversation, native_tools

router = APIRouter()

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
    # an error's `param` names the field alone (see `api.errors`), not the tag.
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


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    model = _served(_ctx(request), body.model)
    tokenizer = model.codec.tokenizer
    if isinstance(body, TokenizeChatRequest):
        ids = await chat_prompt_ids(model, body)
    else:
        model.check_size([body.prompt], "prompt")
        ids = list(await run_in_threadpool(tokenizer.encode, body.prompt,
                                           add_special_tokens=body.add_special_tokens))
    pieces = await run_in_threadpool(_pieces, tokenizer, ids) if body.return_token_strs else None
    return json_response({"count": len(ids), "max_model_len": model.info.max_model_len,
                          "tokens": ids, "token_strs": pieces})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    model = _served(_ctx(request), body.model)
    tokenizer = model.codec.tokenizer
    limit = model.info.max_model_len
    if len(body.tokens) > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; tokens "
                       f"holds {len(body.tokens)}.", param="tokens",
                       code="context_length_exceeded")
    vocab = len(tokenizer)
    for i, token in enumerate(body.tokens):
        if token >= vocab:
            raise APIError(400, f"token id {token} is outside the vocabulary (0..{vocab - 1})",
                           param=f"tokens[{i}]", code="invalid_value")
    text = await run_in_threadpool(tokenizer.decode, body.tokens)
    return json_response({"prompt": cast(str, text)})


async def chat_prompt_ids(model: ServedModel,
                          body: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
    """A chat's prompt, as chat completion builds it and /tokenize counts it."""
    model.check_size([m.text() for m in body.messages], "messages")
    tools = body.tools if body.tool_choice != "none" else None
    turns, native = conversation(body.messages, tools, native_tools(model.codec.tokenizer))
    options = ChatOptions(tools=native, add_generation_prompt=body.add_generation_prompt,
                          continue_final_message=body.continue_final_message,
                          add_special_tokens=body.add_special_tokens,
                          template_kwargs=body.chat_template_kwargs or {})
    try:
        return await model.codec.encode_turns(turns, options)
    except TemplateRefused as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None


def _pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    return cast(list[str], tokenizer.convert_ids_to_tokens(ids))


def _ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


def _served(ctx: AppContext, name: str | None) -> ServedModel:
    """The model named, or with no name (vLLM's default model) the replica's only one."""
    served = ", ".join(f"'{n}'" for n in ctx.models)
    if not name:
        if len(ctx.models) == 1:
            return next(iter(ctx.models.values()))
        raise APIError(400, f"model is required: this server serves {served}.", param="model",
                       code="invalid_value")
    model = ctx.models.get(name)
    if model is None:
        raise APIError(404, f"The model '{name}' does not exist; this server serves "
                       f"{served}.", param="model", code="model_not_found")
    return model

