"""Chat completions (`chat.completion`, `chat.completion.chunk`): a role chunk per choice
first, text as `delta.content`, tool calls as `delta.tool_calls`, logprobs as
`{content: [{token, logprob, bytes, top_logprobs}]}` (the Responses API shares those items).
"""

from __future__ import annotations

from typing import Any, ClassVar

from api.protocol.tools.parse import ParsedCall
from api.render.choices import Choice, TokenLogprob


def logprob_item(t: TokenLogprob) -> dict[str, Any]:
    """A token's logprobs as chat (and the Responses API) shows them."""
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
            "top_logprobs": [{"token": token, "logprob": lp, "bytes": list(token.encode())}
                             for token, lp in t.top]}


class ChatShape:
    """Chat's `ChoiceShape` (`api.render.chunks`)."""

    ID_PREFIX: ClassVar[str] = "chatcmpl"
    CHUNK: ClassVar[str] = "chat.completion.chunk"
    WHOLE: ClassVar[str] = "chat.completion"

    def __init__(self, choices: list[Choice]) -> None:
        self._choices = choices

    def opening(self) -> list[tuple[int, dict[str, Any]]]:
        # A role chunk per choice first.
        return [(c.index, {"delta": {"role": "assistant", "content": ""}})
                for c in self._choices]

    def delta(self, text: str | None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"delta": delta}

    def chunk_logprobs(self, choice: Choice, text: str, items: list[TokenLogprob]
                       ) -> dict[str, Any] | None:
        return self.whole_logprobs(choice, items) if items else None

    def whole_logprobs(self, choice: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [logprob_item(t) for t in items]}

    def whole_choice(self, text: str, calls: list[ParsedCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            # As OpenAI answers: no content beside the calls unless the model wrote some.
            message["content"] = text.strip() or None
            message["tool_calls"] = [c.as_openai() for c in calls]
        return {"message": message}
