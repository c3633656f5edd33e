"""Constrained decoding's common ground: the grammar a request carries, in llguidance's format.

The replica turns what a client asks for (`response_format`, vLLM's `structured_outputs` and
`guided_*`, forced tool calls) into one llguidance grammar and checks it against the model's
tokenizer before the request is queued, so a bad schema is the client's 400, never a worker's
failure. The worker compiles the same text into a matcher that masks each sampled token.

llguidance was chosen by measurement (`ops/benchmarks/grammar_libraries.py`; docs/benchmarks.md): it
compiles a schema cold in under a millisecond (xgrammar takes a few, outlines-core tens to
thousands), so each request's grammar is compiled fresh; it needs no other package; and its
Lark grammars embed JSON schemas, as forced tool calls need. Its masks are slower than
xgrammar's by a fraction of a millisecond per step, under 1% of a decode step. The parser
limits below bound what one request's grammar can cost a shared worker step.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

# Per-step bounds (llguidance's defaults are generous for one process serving one user): a
# pathological grammar fails its own request instead of stalling every row of the batch.
LIMITS = llguidance.LLParserLimits(step_lexer_fuel=200_000, step_max_items=50_000,
                                   max_grammar_size=200_000, verbose_errors=False)

# Strict, compact JSON: no free whitespace, which a model (a small one especially) can pad
# without end until max_tokens cuts the document short.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint cannot be compiled: the client's request is at fault."""


def tokenizer_view(tokenizer: PreTrainedTokenizerBase, n_vocab: int | None = None,
                   eos_token_ids: tuple[int, ...] = ()) -> llguidance.LLTokenizer:
    """llguidance's view of a fast HF tokenizer (about a second to build: build it once).
    `n_vocab` is the model's logits width when it pads the vocabulary."""
    import llguidance.hf  # imports transformers: only where a tokenizer of its is at hand

    eos = list(eos_token_ids) or None
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,  # type: ignore[arg-type]
                                        eos_token=eos)


# Where a JSON schema holds subschemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """A copy of the schema whose every object with declared `properties` admits no others
    unless it says otherwise: OpenAI's strict mode, which the JSON Schema default (any extra
    property allowed) would leave open to a model inventing keys until max_tokens. Recursive: a
    body's JSON parser refuses nesting deep enough to exhaust Python's stack here first."""
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema (llguidance reports the latter)
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def from_json_schema(schema: dict[str, Any] | str) -> str:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"the JSON schema cannot be read: {e}") from None


def from_regex(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def from_lark(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def from_choices(choices: list[str]) -> str:
    """Exactly one of the strings."""
    return from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Raise `GrammarError` naming the problem if the grammar cannot be compiled, if no output
    can start under it (a rule defined only by itself, a `$ref` cycle), or if following it
    through the text it forces at the start breaks the parser's limits (a schema that nests
    itself without end, thousands of alternatives): a worker would otherwise end the request
    with an empty answer, or with an error after it was queued."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=LIMITS, log_level=0)
    if matcher.is_error():
        raise GrammarError(error_text(matcher))
    matcher.compute_bitmask()
    if matcher.is_error():
        raise GrammarError(f"no output can satisfy the grammar ({error_text(matcher)})")
    forced = matcher.compute_ff_tokens()
    if forced and matcher.consume_tokens(forced) and not matcher.is_stopped():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise GrammarError(f"the grammar is too costly to follow ({error_text(matcher)})")


def error_text(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error without llguidance's trailing verbosity marker."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()
