"""When a request's tokens go into its result stream, the record.

Every step's tokens reach the client through its replica's feed, one entry per step for all of
the replica's requests; writing each token to its request's own stream as well would cost a
command per token, the largest share of what Redis spends on a reply. So the record is
written in chunks: a request's first token on this worker at once (the stream then exists
and shows the request started), then its tokens whenever 16 are waiting, or the oldest has
waited 0.5 s, or the last chunk is 0.5 s old (a token after a pause, a preemption say, goes at
once), and the rest with the finish. So every token the record lacks came within 0.5 s and a
step of the record's last entry, and is still in the feed (kept `FEED_RETENTION_S`): a worker
taking over reads the record and then the feed just after it (worker/broker/recovery.py), a replica
whose client fell behind waits for the record to catch up (api/queue/reader.py), and a resumed
stream reads the record as it grows (api/queue/replay.py), so each continues exactly from what the
client saw.

A chunk whose write fails is kept and written again with the next flush (the outbox, with
its request's terminal entry if it has one, so nothing follows that), so the record never has
a gap; a chunk written twice (a pipeline applied in part) repeats indices that every reader
skips.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import Tokens

CHUNK_TOKENS = 16
CHUNK_S = 0.5


@dataclass
class _Waiting:
    parts: list[Tokens] = field(default_factory=list)
    since: float = 0.0  # when the oldest of them was generated
    written: float = float("-inf")  # when a chunk of the request was last written here

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
        waiting = self._waiting.setdefault(request_id, _Waiting())
        if not waiting.parts:
            waiting.since = now
        waiting.parts.append(tokens)

    def due(self, now: float) -> list[tuple[str, Tokens]]:
        """The chunks to write now, taken out: 16 tokens, tokens that have waited `chunk_s`,
        or any after the last chunk is `chunk_s` old (a request's first one here included)."""
        chunks = []
        for rid, w in self._waiting.items():
            if w.parts and (w.count >= self.chunk_tokens or now - w.since >= self.chunk_s
                            or now - w.written >= self.chunk_s):
                chunks.append((rid, Tokens.joined(w.parts)))
                w.parts, w.written = [], now
        return chunks

    def take(self, request_id: str) -> Tokens | None:
        """All of a request's unwritten tokens, and the request, taken out (it ends or leaves
        this worker)."""
        waiting = self._waiting.pop(request_id, None)
        return Tokens.joined(waiting.parts) if waiting and waiting.parts else None

    def __len__(self) -> int:
        return len(self._waiting)
