"""Text completions (`text_completion`): the echoed prompt first (with `echo`), text as
`text`, logprobs as parallel lists with each token's offset in the text. A completions body
offers no tools, so no call ever reaches this renderer."""

from __future__ import annotations

from typing import Any, ClassVar

from api.protocol.tools.parse import ParsedCall
from api.render.choices import Choice, TokenLogprob


def text_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [dict(t.top) for t in items],
        "text_offset": offsets,
    }


class CompletionsShape:
    """Text completions' `ChoiceShape` (`api.render.chunks`)."""

    ID_PREFIX: ClassVar[str] = "cmpl"
    CHUNK: ClassVar[str] = "text_completion"
    WHOLE: ClassVar[str] = "text_completion"

    def __init__(self, choices: list[Choice]) -> None:
        self._choices = choices
        # Where each choice's next streamed text starts, its echoed prompt included.
        self._offsets = {c.index: len(c.prefix) for c in choices}

    def opening(self) -> list[tuple[int, dict[str, Any]]]:
        # The echoed prompt, if any.
        return [(c.index, self.delta(c.prefix)) for c in self._choices if c.prefix]

    def delta(self, text: str | None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"text": text or ""}

    def chunk_logprobs(self, choice: Choice, text: str, items: list[TokenLogprob]
                       ) -> dict[str, Any] | None:
        offset = self._offsets[choice.index]
        self._offsets[choice.index] += len(text)
        return text_logprobs(items, offset) if items else None

    def whole_logprobs(self, choice: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        return text_logprobs(items, len(choice.prefix))

    def whole_choice(self, text: str, calls: list[ParsedCall]) -> dict[str, Any]:
        return {"text": text}
