"""A model this replica serves, as the request bodies check themselves against it
(`api.protocol.bodies`): kept apart from the replica's `AppContext` (`api.queue.context`), which
holds one per model, so the protocol types need nothing of the queue side."""

from __future__ import annotations

from dataclasses import dataclass

from api.protocol.errors import APIError
from api.protocol.text import TextCodec
from shared.lora import LoraAdapter
from shared.models import ModelInfo


@dataclass(frozen=True)
class ServedModel:
    """A model this replica serves: its checkpoint facts and its tokenizer, and for a LoRA
    adapter (`shared/lora.py`) the adapter, served over that model (its base)."""

    info: ModelInfo
    codec: TextCodec
    lora: LoraAdapter | None = None

    @property
    def name(self) -> str:
        """What clients put in "model": the model's name, or the adapter's."""
        return self.lora.name if self.lora is not None else self.info.name

    @property
    def base(self) -> str:
        """The model whose queue and workers serve it (its keys are under this name)."""
        return self.info.name

    @property
    def lora_name(self) -> str:
        """The adapter a request for it carries ("" for the base)."""
        return self.lora.name if self.lora is not None else ""

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this, less one (the tokenizer's added tokens included)."""
        return len(self.codec.tokenizer)

    def check_size(self, texts: list[str], param: str) -> None:
        """A 400 for text far too long for the context, before it is tokenized."""
        limit = self.info.max_model_len
        size = self.codec.surely_too_long(texts, limit)
        if size is not None:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the "
                           f"{param} text ({size} bytes) is far longer than that.",
                           param=param, code="context_length_exceeded")
