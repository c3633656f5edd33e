"""Chat completions (`chat.completion`, `chat.completion.chunk`): a role chunk per choice
first, text as `delta.content`, tool calls as `delta.tool_calls`, logprobs as
`{content: [{token, logprob, bytes, top_logprobs}]}` (the Responses API shares those items).
"""

from __future__ import annotations

from typing import Any

from api.protocol.tools.parse import ParsedCall
from api.render.choices import Choice, TokenLogprob
from api.render.chunks import ChoicesRenderer
from api.render.renderer import Event


def logprob_item(t: TokenLogprob) -> dict[str, Any]:
    """A token's logprobs as chat (and the Responses API) shows them."""
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
            "top_logprobs": [{"token": token, "logprob": lp, "bytes": list(token.encode())}
                             for token, lp in t.top]}


class ChatRenderer(ChoicesRenderer):
    ID_PREFIX = "chatcmpl"
    CHUNK = "chat.completion.chunk"
    WHOLE = "chat.completion"

    def opening(self) -> list[Event]:
        return [self._chunk(c.index, self._delta("", role=True)) for c in self.choices]

    def _delta(self, text: str | None, role: bool = False,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"delta": delta}

    def _chunk_logprobs(self, choice: Choice, text: str, items: list[TokenLogprob]
                        ) -> dict[str, Any] | None:
        return self._whole_logprobs(choice, items) if items else None

    def _whole_logprobs(self, choice: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [logprob_item(t) for t in items]}

    def _whole_choice(self, text: str, calls: list[ParsedCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            # As OpenAI answers: no content beside the calls unless the model wrote some.
            message["content"] = text.strip() or None
            message["tool_calls"] = [c.as_openai() for c in calls]
        return {"message": message}
