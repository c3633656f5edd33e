"""OpenAI request bodies. Unknown fields are refused (400 naming the field), never ignored;
fields of OpenAI's API that cannot change the output are accepted and unused, and
vLLM's request extensions that clients and benchmark tools send are served as vLLM serves them.

A body also owns what can only be checked against the model that serves it, as vLLM's do
(`validate_for`: token ids within its vocabulary; `max_tokens_for`: each prompt within its
context), and turns itself into the `SamplingParams` a worker runs (`to_sampling_params`), so
serving a request is only building it and starting it.

Every input is bounded (the limits in `api.protocol.fields`, each refused with a 400 naming it), so
no single request can make a replica do unbounded work: a stop string is scanned on every token, a
choice is a queued request, a logit_bias entry is work in every sampling step. The body as a
whole is bounded before it is parsed (`api.auth.guard`), and the prompt by the model's context.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from api.protocol.errors import APIError, FieldError
from api.protocol.fields import (
    INT64,
    MAX_CHOICES,
    MAX_GUIDED_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_METADATA,
    MAX_N,
    MAX_PRIORITY,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    MAX_TOOLS,
    TOKEN_ID_DIGITS,
    ChatMessage,
    Name,
    NamedToolChoice,
    StopString,
    StrictModel,
    Text,
    TokenId,
    TokenIds,
    Tool,
    ToolChoice,
)
from api.protocol.served_model import ServedModel
from shared.messages import SamplingParams


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, every chunk carries the usage
    # so far, not only the last one.
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # OpenAI's padding against side channels: none here


class JSONSchemaFormat(StrictModel):
    name: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    # The field is `schema` on the wire; pydantic keeps that name for its own method.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool = False

    model_config = ConfigDict(populate_by_name=True)  # merged with StrictModel's


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> Any:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema goes with type 'json_schema', and "
                             "only with it")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (its older `guided_*` fields say the same): exactly one."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = None
    grammar: str | None = None  # Lark (what llguidance reads), or a GBNF grammar
    json_object: bool | None = None

    model_config = ConfigDict(populate_by_name=True)  # merged with StrictModel's

    @model_validator(mode="after")
    def _exactly_one(self) -> Any:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             "grammar, json_object")
        return self


class _Common(StrictModel):
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
    response_format: ResponseFormat | None = None
    # vLLM's extensions.
    min_tokens: Annotated[int, Field(ge=0)] = 0
    # Lower is taken from the queue first (worker/broker/take.py), as vLLM's priority scheduling.
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # what the fast tokenizers do anyway
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1,
                                               max_length=MAX_GUIDED_CHOICES)] | None = None
    guided_grammar: str | None = None
    # redserve's: false keeps this request's worker from speculating on it (one token a step;
    # the output is the same either way, see docs/http-api.md).
    speculation: bool = True
    # OpenAI's fields that change nothing in the output: checked, then unused.
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    store: bool = False
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    prompt_cache_key: Name | None = None
    prompt_cache_retention: Annotated[str, Field(max_length=32)] | None = None
    safety_identifier: Name | None = None
    prediction: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # Only ASCII digits: str.isdigit() also accepts "²" and other digits int() refuses.
            if not (key.isascii() and key.isdigit() and len(key) <= TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys are token ids (decimal digits), got "
                                 f"{key[:TOKEN_ID_DIGITS + 2]!r}")
        return v

    def _constraints(self) -> list[tuple[str, bool]]:
        """Each field that may constrain the output, and whether it does here."""
        return [
            ("response_format", self.response_format is not None
             and self.response_format.type != "text"),
            ("structured_outputs", self.structured_outputs is not None),
            ("guided_json", self.guided_json is not None),
            ("guided_regex", self.guided_regex is not None),
            ("guided_choice", self.guided_choice is not None),
            ("guided_grammar", self.guided_grammar is not None),
        ]

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> Any:
        most = self.requested_max_tokens()
        if most is not None and self.min_tokens > most:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) is more than the "
                             f"max_tokens ({most})")
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> Any:
        given = [name for name, v in self._constraints() if v]
        if len(given) > 1:
            raise FieldError(given[1], f"{' and '.join(given)} each constrain the output: "
                             "give one")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options",
                             "stream_options is only allowed when stream is true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def validate_for(self, model: ServedModel) -> None:
        """A 400 for a token id (`logit_bias`, `stop_token_ids`) outside `model`'s vocabulary."""
        vocab = model.vocab_size
        for param, ids in (("logit_bias", [int(k) for k in self.logit_bias or {}]),
                           ("stop_token_ids", self.stop_token_ids or [])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"{param}: token id {bad} is outside the vocabulary "
                               f"(0..{vocab - 1})", param=param, code="invalid_value")

    def max_tokens_for(self, model: ServedModel, prompt_ids: list[int]) -> int:
        """The `max_tokens` of this prompt's choices: as asked, or the rest of `model`'s
        context when not; a 400 for an empty prompt or one that leaves no room."""
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        limit, prompt_tokens = model.info.max_model_len, len(prompt_ids)
        requested = self.requested_max_tokens()
        if requested is None:
            if prompt_tokens >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens, "
                               f"but the prompt has {prompt_tokens} tokens.", param="messages",
                               code="context_length_exceeded")
            return limit - prompt_tokens
        if prompt_tokens + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {prompt_tokens + requested} tokens "
                           f"({prompt_tokens} in the prompt, {requested} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    def to_sampling_params(self, max_tokens: int, index: int) -> SamplingParams:
        """What the worker runs for choice `index` of the reply (its seed: the body's plus
        `index`, so choices differ and a reply repeats)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            # "1" and "01" are one token: the last of them counts, once.
            logit_bias=tuple({int(k): v for k, v in (self.logit_bias or {}).items()}.items()),
            logprobs=self.top_logprobs_count(),
            min_tokens=min(self.min_tokens, max_tokens),
            speculate=self.speculation,
        )

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
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=16)] | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> Any:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError("tools", "two functions share a name")
        choice = self.tool_choice
        if choice in ("auto", "required") and not names:
            raise FieldError("tool_choice", f"tool_choice {choice!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names function "
                             f"{choice.function.name!r}, which is not among the tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message and "
                             "add_generation_prompt cannot both be true")
        return self

    def _constraints(self) -> list[tuple[str, bool]]:
        return [("tool_choice", self.calls_forced()), *super()._constraints()]

    def calls_forced(self) -> bool:
        """`tool_choice` required or a named function: the output is constrained to calls."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def tools_in_use(self) -> bool:
        """Whether the model is offered the tools (`tool_choice` none hides them)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_function(self) -> str | None:
        """The one function a call must be, when the output is constrained to calls: the
        named `tool_choice`, or `required` with a single tool."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        if self.tool_choice == "required" and self.tools and len(self.tools) == 1:
            return self.tools[0].function.name
        return None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> Any:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
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
    add_special_tokens: bool = True
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
            raise FieldError("n", f"{len(self.prompts())} prompts x n={self.n} is over the "
                             f"limit of {MAX_CHOICES} choices per request")
        return self

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> Any:
        if self.echo and self.logprobs is not None:
            raise FieldError("echo", "echo with logprobs (prompt logprobs) is not supported")
        return self

    def check_prompts(self, model: ServedModel) -> None:
        """Before any is tokenized: a 400 for prompt text far too long for `model`'s context,
        or a prompt token id outside its vocabulary."""
        for text in (p for p in self.prompts() if isinstance(p, str)):
            # Each on its own: the prompts of a batch do not share one context.
            model.check_size([text], "prompt")
        vocab = model.vocab_size
        for ids in (p for p in self.prompts() if not isinstance(p, str)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary "
                               f"(0..{vocab - 1})", param="prompt", code="invalid_value")

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
