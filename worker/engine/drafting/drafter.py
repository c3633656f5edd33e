"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the last
few tokens, from an n-gram index kept per request.

Every n-gram (n from `MIN_NGRAM` to `MAX_NGRAM`) of the request's tokens, prompt and output,
maps to where its latest occurrence ends. A draft matches the request's last `MAX_NGRAM`
tokens first, then shorter suffixes, and proposes the continuation after the match. The index
is brought up to date lazily, when the request drafts: each token is indexed once (a few dict
writes), so a step's draft costs O(k) plus the tokens appended since the last one, never a scan
of the context. Drafts are only guesses: the model verifies each (`verify.py`), so a wrong or
colliding entry costs acceptance, never correctness.

A match that ends close to the end of the tokens (a repeating pattern) continues with the
draft itself: after `a b c a b`, the match `a b` ending two tokens back proposes `c a b c ...`,
one period at a time, rather than stopping at the end of what is known.
"""

from __future__ import annotations

from collections.abc import Sequence

# Two tokens matched at least: a lone common token (a space, a comma) is followed by anything.
MIN_NGRAM = 2
MAX_NGRAM = 3


class NgramIndex:
    """One request's n-grams: where each last ended, up to the tokens seen so far."""

    def __init__(self, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._indexed = 0  # n-grams ending at or before this position are in `_ends`

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens to follow `tokens` (a sequence that only ever grows), or none
        when no suffix of it occurred before."""
        length = len(tokens)
        self._index(tokens, length - 1)  # every n-gram that ends before the suffix
        if k <= 0:
            return ()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[length - n:]))
            if end is None:
                continue
            period = length - end  # > 0: only n-grams ending before the last token are indexed
            draft: list[int] = []
            for i in range(k):
                draft.append(tokens[end + i] if i < period else draft[i - period])
            return tuple(draft)
        return ()

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        ends = self._ends
        for end in range(self._indexed + 1, upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, upto)
