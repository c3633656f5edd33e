"""What rendering a reply needs, derived from its request body once.

A reply is rendered in two places: by the replica that took the request
(`api.endpoints.serving.generate`) and, for a resumed stream, by whichever replica serves `GET
/v1/requests/{id}/stream` (`api.endpoints.serving.resume`), from the copy stored in the request's
hash (`api.queue.replay.StreamView`). The two must render the same events, so both build their
choices (`api.render.choices.reply_choice`) and their renderer (`api.render.formats`) from one
`ReplySpec` with the same functions, and the stored copy is that spec itself: a setting read
from the body in one place cannot be forgotten, or passed in the wrong position, in the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from api.protocol.bodies import ChatCompletionRequest, CompletionRequest

# The wire format a `ReplySpec` renders: chat or completions (the Responses API is rendered from
# a chat spec, with its own state beside it: `api.endpoints.responses.resume`).
Kind = Literal["chat", "completions"]
# Where a stream reports usage: nowhere, in one last chunk (`include_usage`), or also in every
# chunk as it stands so far (vLLM's `continuous_usage_stats`, which load testers read).
UsageMode = Literal["off", "final", "every"]


@dataclass(frozen=True)
class ReplySpec:
    kind: Kind
    base_id: str  # the request's id; its choices are `<id>`, `<id>-1` .. `<id>-<n-1>`
    model: str
    created: int
    prompt_tokens: int  # of all prompts together
    prefixes: tuple[str, ...]  # per prompt: its text echoed before the completion, or ""
    stops: tuple[str, ...]
    include_stop: bool  # a stop string that ends the text is shown
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (stream_options.continuous_usage_stats)
    tools: bool  # the model was offered tools: its calls are parsed out
    one_call: bool  # parallel_tool_calls false: only the first call is kept
    forced_function: str | None  # the one function calls must be (`tool_choice`), if any
    skip_special_tokens: bool

    @classmethod
    def from_body(cls, body: ChatCompletionRequest | CompletionRequest, kind: Kind,
                  base_id: str, model: str, created: int, prompts: list[list[int]],
                  echoes: list[str] | None) -> ReplySpec:
        """`echoes`: each prompt's text, when the body asks for it back (`echo`)."""
        chat = body if isinstance(body, ChatCompletionRequest) else None
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        return cls(
            kind=kind,
            base_id=base_id,
            model=model,
            created=created,
            prompt_tokens=sum(len(p) for p in prompts),
            prefixes=tuple(echoes) if echoes else ("",) * len(prompts),
            stops=tuple(body.stop_strings()),
            include_stop=body.include_stop_str_in_output,
            include_usage=include_usage,
            continuous_usage=bool(include_usage and options and options.continuous_usage_stats),
            tools=chat is not None and chat.tools_in_use(),
            one_call=chat is not None and not chat.parallel_tool_calls,
            forced_function=chat.forced_function() if chat is not None else None,
            skip_special_tokens=body.skip_special_tokens,
        )

    @property
    def usage_mode(self) -> UsageMode:
        if not self.include_usage:
            return "off"
        return "every" if self.continuous_usage else "final"
