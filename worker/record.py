"""When a request's tokens go into its result stream, the record.

Every step's tokens reach the client through its replica's feed, one entry per step for all of
the replica's requests; writing each token to its request's own stream as well would cost a
command per token, the largest share of what Redis spends on a reply. So the record is
written in chunks: a request's first token at once (the stream then exists and shows the
request started), then its tokens whenever 16 are waiting or the oldest has waited 0.5 s, and
the rest with the finish. The record thus trails the feed by at most a chunk, and what it
lacks is still in the feed (kept `FEED_RETENTION_S`): a worker taking over reads the record
and then the feed after it (worker/recovery.py), a replica whose client fell behind waits
for the record to catch up (api/reader.py), and a resumed stream reads the record as it
grows (api/resume.py), so each continues exactly from what the client saw.

A chunk whose write fails is kept and written again with the next flush (the outbox), so the
record never has a gap; a chunk written twice (a pipeline applied in part) repeats indices
that every reader skips.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import Tokens

CHUNK_TOKENS = 16
CHUNK_S = 0.5


@dataclass
class _Waiting:
    parts: list[Tokens]
    since: float  # when the oldest of them was generated

    @property
    def count(self) -> int:
        return sum(len(p.ids) for p in self.parts)


@dataclass
class Record:
    """The tokens of each request not yet written to its result stream."""

    chunk_tokens: int = CHUNK_TOKENS
    chunk_s: float = CHUNK_S
    _waiting: dict[str, _Waiting] = field(default_factory=dict)

    def add(self, request_id: str, tokens: Tokens, now: float) -> None:
        waiting = self._waiting.get(request_id)
        if waiting is None:
            self._waiting[request_id] = _Waiting([tokens], now)
        else:
            waiting.parts.append(tokens)

    def due(self, now: float) -> list[tuple[str, Tokens]]:
        """The chunks to write now, taken out: a request's first token, 16 tokens, or tokens
        that have waited `chunk_s`."""
        due = [rid for rid, w in self._waiting.items()
               if w.parts[0].index == 0 or w.count >= self.chunk_tokens
               or now - w.since >= self.chunk_s]
        return [(rid, Tokens.joined(self._waiting.pop(rid).parts)) for rid in due]

    def take(self, request_id: str) -> Tokens | None:
        """All of a request's unwritten tokens, taken out (it ends or leaves this worker)."""
        waiting = self._waiting.pop(request_id, None)
        return None if waiting is None else Tokens.joined(waiting.parts)

    def __len__(self) -> int:
        return len(self._waiting)
