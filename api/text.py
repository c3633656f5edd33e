"""Text in and text out: chat templates and tokenization (off the event loop), and incremental
detokenization that never splits a multi-byte character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from starlette.concurrency import run_in_threadpool
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from api.protocol import ChatMessage


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

    async def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        convo = [{"role": m.role, "content": m.text()} for m in messages]
        return await run_in_threadpool(self._apply_template, convo)

    async def encode_text(self, text: str) -> list[int]:
        return await run_in_threadpool(self._encode, text)

    def _apply_template(self, convo: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            convo, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in cast(list[int], ids)]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return cast(str, self.tokenizer.decode([token_id]))

    def decode(self, ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Decoding a lone token can yield half of a UTF-8 character (shown as U+FFFD) or drop a
    space that depends on its neighbour, so each step decodes a short window that starts a few
    tokens back and emits only what the window adds beyond its already-shown prefix, holding
    back a trailing U+FFFD until the next token completes the character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # end of the part of the window already shown

    def _decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))

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
