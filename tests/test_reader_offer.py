"""How a request's result entries are placed in its queue, wherever they come from (the
replica's feed, or the request's own stream when catching up): by token index, so a repeat is
dropped, a gap is noticed, and a batch goes in whole or not at all; and how a record's chunk
is taken apart for a streamed reply."""

from __future__ import annotations

import asyncio

from api.queue.subscription import Subscription
from shared.messages import Error, Finish, Tokens, expand


def _sub(size: int = 8) -> Subscription:
    return Subscription("feedbeef-1", "out", asyncio.Queue(size))


def _drain(sub: Subscription) -> list[object]:
    return [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]


def test_repeats_are_dropped_and_overlaps_trimmed() -> None:
    sub = _sub()
    assert sub.offer([Tokens(0, (1, 2))], 6) == "ok"
    assert sub.offer([Tokens(0, (1, 2))], 6) == "ok"  # a retried publish
    assert sub.offer([Tokens(1, (2, 3))], 6) == "ok"  # a resumed worker's overlap
    assert _drain(sub) == [Tokens(0, (1, 2)), Tokens(2, (3,))]
    assert sub.next_index == 3


def test_a_gap_is_reported_and_nothing_of_the_batch_is_queued() -> None:
    sub = _sub()
    assert sub.offer([Tokens(0, (1,))], 6) == "ok"
    # The finish carries token 2; token 1 never came.
    assert sub.offer([Tokens(2, (9,)), Finish("length", 1, 3)], 6) == "gap"
    assert _drain(sub) == [Tokens(0, (1,))] and not sub.ended


def test_a_batch_that_does_not_fit_waits_whole() -> None:
    sub = _sub()
    assert sub.offer([Tokens(i, (i,)) for i in range(5)], 6) == "ok"
    assert sub.offer([Tokens(5, (5,)), Finish("length", 1, 6)], 6) == "full"
    assert sub.queue.qsize() == 5 and sub.next_index == 5 and not sub.ended
    _drain(sub)
    assert sub.offer([Tokens(5, (5,)), Finish("length", 1, 6)], 6) == "ok" and sub.ended
    assert sub.offer([Error("late")], 6) == "ok" and sub.queue.qsize() == 2  # ended: ignored


def test_a_chunk_is_rendered_one_token_at_a_time() -> None:
    chunk = Finish("length", 3, 3, 0, Tokens(1, (7, 8), ((-0.5, ()), (-0.25, ())), 12))
    tokens, finish = expand(chunk)
    assert isinstance(tokens, Tokens) and finish == Finish("length", 3, 3, 0)
    assert tokens.split() == [Tokens(1, (7,), ((-0.5, ()),), 12), Tokens(2, (8,), ((-0.25, ()),))]
    assert Tokens.joined(tokens.split()) == tokens


def test_the_stash_keeps_the_newest_feed_entries() -> None:
    sub = _sub()
    sub.keep([Tokens(i, (i,)) for i in range(5)], 3)
    sub.keep([Finish("length", 1, 5)], 3)
    assert sub.stash == [Tokens(3, (3,)), Tokens(4, (4,)), Finish("length", 1, 5)]
