"""Text in and text out: chat templates and tokenization (off the event loop), and incremental
detokenization that never splits a multi-byte character."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# apply_chat_template's own parameters: `chat_template_kwargs` may not set them.
_TEMPLATE_PARAMS = frozenset({"conversation", "tools", "documents", "chat_template",
                              "add_generation_prompt", "continue_final_message", "tokenize",
                              "padding", "truncation", "max_length", "return_tensors",
                              "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                              "sanitize_control_tokens"})


class TemplateRefused(ValueError):
    """The chat template cannot render these messages (its own check, or a bad option)."""


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered: vLLM's chat request extensions, and the tools."""

    tools: list[dict[Any, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


class TextCodec:
    def __init__(self, path: str) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
        # The most UTF-8 bytes one token can stand for: a byte-level BPE token's string has a
        # character per byte; other tokenizers get a generous margin (normalizers may fold
        # several characters into one). Text longer than this times the context cannot fit,
        # and is refused without spending the tokenizer's time on it.
        longest = max(len(piece) for piece in self.tokenizer.get_vocab())
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        byte_level = (backend is not None and backend.normalizer is None
                      and type(backend.pre_tokenizer).__name__ == "ByteLevel")
        self.max_token_bytes = longest if byte_level else 16 * longest

    def surely_too_long(self, texts: Sequence[str], max_tokens: int) -> int | None:
        """The texts' size in bytes if they cannot fit in `max_tokens` tokens, else None."""
        size = sum(len(t.encode()) for t in texts)
        return size if size > max_tokens * self.max_token_bytes else None

    async def encode_turns(self, turns: list[dict[str, Any]],
                           options: ChatOptions = ChatOptions()) -> list[int]:
        return await run_in_threadpool(self._apply_template, turns, options)

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await run_in_threadpool(self._encode, text, add_special_tokens)

    def _apply_template(self, convo: list[dict[str, Any]], options: ChatOptions) -> list[int]:
        bad = sorted(set(options.template_kwargs) & _TEMPLATE_PARAMS)
        if bad:
            raise TemplateRefused(f"chat_template_kwargs may not set {', '.join(bad)}")
        try:
            text = self.tokenizer.apply_chat_template(
                convo, tools=cast(Any, options.tools),
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=False,
                **options.template_kwargs)
        except (TemplateError, ValueError, TypeError) as e:
            raise TemplateRefused(f"the chat template cannot render these messages: {e}") from e
        return list(self.tokenizer.encode(cast(str, text),
                                          add_special_tokens=options.add_special_tokens))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_text(self, token_id: int) -> str:
        return cast(str, self.tokenizer.decode([token_id]))

    def decode(self, ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer, skip_special_tokens)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Decoding a lone token can yield half of a UTF-8 character (shown as U+FFFD) or drop a
    space that depends on its neighbour, so each step decodes a short window that starts a few
    tokens back and emits only what the window adds beyond its already-shown prefix, holding
    back a trailing U+FFFD until the next token completes the character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # end of the part of the window already shown

    def _decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        shown = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(shown) or window.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return window[len(shown) :]

    def flush(self) -> str:
        """Whatever is still held back (only invalid bytes from the model leave U+FFFD)."""
        shown = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window[len(shown) :] if len(window) > len(shown) else ""
