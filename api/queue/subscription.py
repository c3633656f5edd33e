"""One request's place in its replica's result reader (api/queue/reader.py): the bounded queue its
handler reads, and how far its results have come.

Results arrive from the feed and, when the request is behind, from its record, and either may
repeat or skip: `offer` places entries by token index, so an entry seen twice is dropped and
one that skips ahead is refused as a gap (the reader then catches the request up from its
record, or ends it if the record itself has the gap). `fail` ends it from this side.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shared.messages import Error, Finish, ResultEntry, Tokens


@dataclass
class Subscription:
    request_id: str
    key: str  # its result stream
    queue: asyncio.Queue[ResultEntry]
    next_index: int = 0  # the next token index it expects
    ended: bool = False  # a terminal entry has been routed
    failed: bool = False  # ...and it came from this replica, not from a worker
    behind: bool = False  # off the feed: reads its own stream until level
    stream_id: bytes | str = "0-0"  # how far it has read its own stream
    behind_since: float | None = None  # when it last had no room
    # While behind: its newest feed entries, to rejoin the feed with once the record is read.
    stash: list[ResultEntry] = field(default_factory=list)
    level: bool = False  # read to its record's end, not yet back on the feed
    polled: float = 0.0  # when its record was last read

    def fail(self, error: Error) -> None:
        """End the request here: drop what is buffered, deliver `error` next."""
        if self.ended:
            return
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(error)
        self.ended = self.failed = True

    def offer(self, entries: list[ResultEntry], room: int) -> str:
        """Queue what is new in `entries` (in order, all or none): "ok", or why it cannot
        ("gap": tokens are missing before these; "full": no room)."""
        fresh: list[ResultEntry] = []
        expected = self.next_index
        for entry in entries:
            if isinstance(entry, Tokens):
                skip = expected - entry.index
                if skip < 0:
                    return "gap"
                if skip >= len(entry.ids):
                    continue  # seen already
                if skip:
                    entry = Tokens(expected, entry.ids[skip:],
                                   entry.logprobs[skip:] if entry.logprobs else None)
                expected = entry.index + len(entry.ids)
            fresh.append(entry)
        if self.ended or not fresh:
            return "ok"
        if self.queue.qsize() + len(fresh) > room:
            return "full"
        for entry in fresh:
            self.queue.put_nowait(entry)
        self.next_index = expected
        self.ended = isinstance(fresh[-1], Finish | Error)
        return "ok"

    def keep(self, entries: list[ResultEntry], limit: int) -> None:
        """Stash feed entries that arrived while behind: the newest `limit`."""
        self.stash.extend(entries)
        del self.stash[:-limit]
