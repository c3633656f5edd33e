"""vLLM's `/tokenize` and `/detokenize`: the token ids a prompt becomes, and the text token
ids stand for, answered by the replica alone, with no worker and no Redis.

Clients call them to count a prompt against the context before sending it, to build prompts
as token ids, and to read back ids they hold. A count is only useful if it is the count the
generation routes would reach, so the same tokenizer does the work, and a chat body is
rendered exactly as `/v1/chat/completions` renders it (`api.protocol.tools.prompt.conversation`,
then
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

from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedTokenizerBase

from api.endpoints.common import app_context, served, served_names, tenant_of
from api.endpoints.serving import chat_prompt_ids
from api.protocol.errors import APIError
from api.protocol.http import json_response
from api.protocol.served_model import ServedModel
from api.protocol.tokenize_body import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest

router = APIRouter()

@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    model = await _served(request, body.model)
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
    model = await _served(request, body.model)
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


def _pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    return cast(list[str], tokenizer.convert_ids_to_tokens(ids))


async def _served(request: Request, name: str | None) -> ServedModel:
    """The model (or LoRA adapter) named, or with no name (vLLM's default model) the replica's
    only one."""
    ctx = app_context(request)
    if not name:
        if len(ctx.models) == 1:
            return next(iter(ctx.models.values()))
        raise APIError(400, f"model is required: this server serves "
                       f"{served_names(ctx, tenant_of(request))}.", param="model",
                       code="invalid_value")
    return await served(ctx, name, tenant_of(request))

