"""OpenAI request bodies. Unknown fields are refused (400 naming the field), never ignored.

Every input is bounded (the limits below, each refused with a 400 naming it), so no single
request can make a replica do unbounded work: a stop string is scanned on every token, a
choice is a queued request, a logit_bias entry is work in every sampling step. The body as a
whole is bounded before it is parsed (`api.auth.guard`), and the prompt by the model's context.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_CHOICES = 128  # prompts x n in one request: each is a queued request of its own
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_PARTS = 256  # content parts of one message
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_NAME_CHARS = 256  # model, user, message name
TOKEN_ID_DIGITS = 10
INT64 = 2**63


class _Strict(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused like any bad number,
    # and so are values of the wrong JSON type ("4" or true for an integer, 4.0 for a token id).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's API takes `null` for "use the default" on every optional field, and
        # clients send it so.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _valid_unicode(text: str) -> str:
    # JSON's \ud800-style escapes can carry lone surrogates, which no tokenizer accepts.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (not valid Unicode)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)]
    name: Name | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


class _Common(_Strict):
    model: Name
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
        # Checked by `_bias_keys_are_ids` (for its message); stated here for the schema.
        Field(max_length=MAX_LOGIT_BIAS,
              json_schema_extra={"propertyNames": {"pattern": f"^[0-9]{{1,{TOKEN_ID_DIGITS}}}$"}}),
    ] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # Only ASCII digits: str.isdigit() also accepts "²" and other digits int() refuses.
            if not (key.isascii() and key.isdigit() and len(key) <= TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys are token ids (decimal digits), got "
                                 f"{key[:TOKEN_ID_DIGITS + 2]!r}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; N: the chosen token's and N alternatives."""
        return None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> Any:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)])
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> None:
        if v is not None:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return None

    @model_validator(mode="after")
    def _bounded_choices(self) -> Any:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} is over the limit of "
                             f"{MAX_CHOICES} choices per request")
        return self

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> Any:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (prompt logprobs) is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]

    def top_logprobs_count(self) -> int | None:
        return self.logprobs
