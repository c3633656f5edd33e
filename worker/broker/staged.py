"""What a worker's flush writes, between the step that produced it and Redis having it
(worker/broker/publisher.py): per request, its feed entries, record chunks, state and terminal
entry, and the request-stream entries to acknowledge or hand back. A flush that fails keeps
what must not be lost in a second `Staged`, the outbox, which later flushes retry first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from shared.messages import Error, Finish, RequestHash, Tokens
from worker.broker.clock import Clock


@dataclass(frozen=True)
class Ending:
    """A request's terminal entry, until Redis has it."""

    request_id: str
    entry: Finish | Error  # for the record: a finish carries every unrecorded token
    live: Finish | Error  # for the feed: a finish carries only its step's token
    expires: float  # unix time past which its keys are gone anyway: stop retrying
    clock: Clock | None = None  # its times, observed once it is written
    again: bool = False  # written before, and written again after a failover

    @cached_property  # read by the stream's XADD, and by the feed on a retry: encoded once
    def fields(self) -> dict[str, str]:
        return self.entry.to_fields()

    @property
    def state(self) -> dict[str, str]:
        """What the request's hash says once this is written."""
        return RequestHash.ended(self.entry)


@dataclass
class Staged:
    live: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # feed only
    records: list[tuple[str, Tokens]] = field(default_factory=list)  # result streams only
    # (request id, the traceparent of its span on this worker, when traced)
    running: list[tuple[str, str | None]] = field(default_factory=list)
    endings: list[Ending] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)  # request-stream entry ids
    hand_backs: list[tuple[str, str]] = field(default_factory=list)  # (request id, entry id)

    def __bool__(self) -> bool:
        return any((self.live, self.records, self.running, self.endings, self.acks,
                    self.hand_backs))

    def drop(self, gone: set[str]) -> None:
        """Forget the requests in `gone` (another worker holds them now)."""
        self.endings = [e for e in self.endings if e.request_id not in gone]
        self.records = [r for r in self.records if r[0] not in gone]
        self.live = [r for r in self.live if r[0] not in gone]
        self.hand_backs = [h for h in self.hand_backs if h[0] not in gone]

    def keep_for_retry(self, outbox: Staged) -> None:
        """What a failed flush must not lose; feed entries and states are dropped (the
        record has the tokens; the requests end with an error)."""
        outbox.records += self.records
        outbox.endings += self.endings
        outbox.acks += self.acks
        outbox.hand_backs += self.hand_backs
