"""Grammar-constrained rows of a batch: each request's matcher, and the masks of one step.

A constrained request carries its grammar (`shared.request_grammar`); the worker compiles it into an
llguidance matcher that lives with the request's `Sequence`. The matcher has seen exactly the
request's output tokens: a preempted request keeps it (its tokens are kept too), and a request
resumed on another worker after a crash replays its published tokens into a fresh one, so the
constraint holds across both.

Each step, the rows to be sampled that carry a matcher get the next-token mask, computed for
all of them at once by llguidance's thread pool (it drops the GIL), turned from bits into an
additive bias (0 or -inf) and added to those rows only: an unconstrained row pays nothing.
The same pass keeps stop tokens out of a row that has not reached its `min_tokens`.

The worker's view of the tokenizer comes from the checkpoint's `tokenizer.json` through the Rust
`tokenizers` library, not through transformers: importing transformers would cost every worker
start about a second of CPU for one object. A checkpoint whose files need transformers' loader
(no `tokenizer.json`, or added tokens that only `tokenizer_config.json` declares) goes through it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
import orjson
import tokenizers
import torch

from shared import request_grammar as grammar

PRISTINE_CACHE = 64  # compiled grammars kept to copy from (n choices share one)

# Row b: the additive bias of the 8 tokens whose mask bits are byte b (bit j, token j): 0 where
# the token is allowed, -inf where it is not.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf
                      ).astype(np.float32)


class ConstraintError(ValueError):
    """The request's grammar cannot run, or its output left the grammar."""


class Constraint:
    """One request's matcher."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError("the output could not go on under its grammar: "
                                  f"{grammar.error_text(self.matcher)}")

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more."""
        return self.matcher.is_stopped()


class Constraints:
    """A worker's compiler of grammars into matchers, and its mask maker."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, threads: int | None = None) -> None:
        self.n_vocab = tokenizer.vocab_size
        self.tokenizer = tokenizer
        self.executor = llguidance.LLExecutor(threads)
        self._pristine: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def start(self, text: str, replay: Sequence[int] = ()) -> Constraint:
        """A matcher for `text` that has consumed `replay` (a resumed request's tokens)."""
        pristine = self._pristine.get(text)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.tokenizer, text, limits=grammar.LIMITS,
                                            log_level=0)
            if pristine.is_error():
                raise ConstraintError("the grammar does not compile: "
                                      f"{grammar.error_text(pristine)}")
            self._pristine[text] = pristine
            if len(self._pristine) > PRISTINE_CACHE:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(text)
        constraint = Constraint(pristine.deep_copy())
        if replay and not constraint.matcher.consume_tokens(list(replay)):
            raise ConstraintError("the published tokens do not follow the grammar: "
                                  f"{grammar.error_text(constraint.matcher)}")
        return constraint

    @torch.inference_mode()  # the logits are an inference tensor: updated in place only here
    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, Constraint]]) -> None:
        """Set to -inf, in place, each listed row's tokens its grammar does not allow now."""
        if not rows:
            return
        words = (self.n_vocab + 31) // 32
        bits = np.zeros((len(rows), words), dtype=np.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(c.matcher, k) for k, (_, c) in enumerate(rows)], bits.ctypes.data, words * 4,
            len(rows))
        # Each byte of the mask looked up as its 8 tokens' bias: a few times faster on CPU than
        # unpacking bits into a boolean mask for masked_fill.
        bias = np.take(_BYTE_BIAS, bits.view(np.uint8), axis=0).reshape(len(rows), -1)
        width = min(logits.shape[-1], bias.shape[1])
        biases = torch.from_numpy(bias[:, :width]).to(logits.device, logits.dtype)
        for k, (i, _) in enumerate(rows):
            logits[i, :width] += biases[k]
            logits[i, width:] = float("-inf")  # padding past the tokenizer's vocabulary


def tokenizer_view(model: Path, n_vocab: int, eos_token_ids: tuple[int, ...]
                   ) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer of the checkpoint in `model`, `n_vocab` wide at least
    (the logits' width: a model may pad its vocabulary)."""
    backend = _backend(model)
    if backend is None:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(str(model))
        return grammar.tokenizer_view(loaded, max(n_vocab, len(loaded)), eos_token_ids)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(),
                                  n_vocab=max(n_vocab, backend.get_vocab_size(True)),
                                  eos_token=list(eos_token_ids) or None)


def _backend(model: Path) -> tokenizers.Tokenizer | None:
    """The checkpoint's `tokenizer.json`, or None where transformers would load more than it."""
    if not (model / "tokenizer.json").exists():
        return None
    backend = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    config = model / "tokenizer_config.json"
    declared = orjson.loads(config.read_bytes()) if config.exists() else {}
    for token_id, token in (declared.get("added_tokens_decoder") or {}).items():
        if backend.id_to_token(int(token_id)) != token.get("content"):
            return None
    return backend


@torch.inference_mode()
def suppress(logits: torch.Tensor, rows: Sequence[tuple[int, frozenset[int]]]) -> None:
    """Keep each listed row's stop tokens from being sampled (`min_tokens` not reached)."""
    for i, ids in rows:
        if ids:
            logits[i, list(ids)] = float("-inf")
