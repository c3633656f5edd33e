"""What a wire format is to the drivers (`api.render.stream`, `api.render.collect`): one small
class per format (`chat`, `completions`, `responses`) that turns the walk's events
(`api.render.walk`) into that format's stream events and, at the end, its whole object. One
renderer serves both replies: a stream sends the events it returns as it goes, a JSON reply
drops them and sends its whole object, so the two cannot differ.
"""

from __future__ import annotations

from typing import Any, Protocol

from sse_starlette import ServerSentEvent

from api.protocol.tools.parse import ParsedCall
from api.render.choices import Choice, TokenLogprob
from shared.messages import Error

# A stream event before numbering: a JSON object, or a bare data line (chat's `[DONE]`).
Event = dict[str, Any] | str


class Renderer(Protocol):
    @property
    def choices(self) -> list[Choice]:
        """The reply's choices, in index order: what the walk reads."""
        ...

    @property
    def first_number(self) -> int:
        """The number of a stream's first event: its SSE id, that a resuming client sends
        back as the last it saw."""
        ...

    def opening(self) -> list[Event]:
        """The events before any choice's output."""
        ...

    def text(self, choice: Choice, text: str, logprobs: list[TokenLogprob]) -> list[Event]:
        ...

    def calls(self, choice: Choice, calls: list[ParsedCall]) -> list[Event]:
        ...

    def end(self, choice: Choice, finish_reason: str) -> list[Event]:
        """The events of one choice's end."""
        ...

    async def final(self) -> list[Event]:
        """A stream's last events, once every choice has ended."""
        ...

    def failed(self, error: Error) -> list[Event]:
        """A stream's last events when the reply failed."""
        ...

    async def whole(self) -> dict[str, Any]:
        """The whole object of a JSON reply, once every choice has ended."""
        ...

    def sse(self, event: Event, number: int) -> ServerSentEvent:
        """The event as sent, numbered."""
        ...
