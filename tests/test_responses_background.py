"""Background responses (`background: true`) through the official `openai` client, against two
real API replicas, a worker and Redis: created on one replica and polled to the end on the
other, cancelled, streamed and resumed, and finished after the replica that admitted it died
(its end derived from the request's result stream), while a conversation that replica
answered goes on on the other."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.responses_stack import MODEL, client, two_replicas
from tests.stack import Stack

OWNER, STRANGER = "sk-background-owner", "sk-background-stranger"
ENV = {"REDSERVE_API_KEYS": f"owner:{OWNER},stranger:{STRANGER}",
       "REDSERVE_RESPONSE_TTL_S": "600"}
ENDED = {"completed", "incomplete", "failed", "cancelled"}


@pytest.fixture(scope="module")
def stack(redis_url: str, tiny_model: Path) -> Iterator[Stack]:
    with two_replicas(redis_url, tiny_model, ENV) as stack:
        yield stack


def _polled(client: openai.OpenAI, response_id: str, timeout: float = 30.0) -> Any:
    """The response, retrieved until it has ended."""
    seen = set()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = client.responses.retrieve(response_id)
        seen.add(r.status)
        if r.status in ENDED:
            return r, seen
        time.sleep(0.05)
    raise AssertionError(f"{response_id} did not end; statuses seen: {seen}")


def test_created_on_one_replica_and_polled_to_the_end_on_the_other(stack: Stack) -> None:
    one, two = client(stack, 0, OWNER), client(stack, 1, OWNER)
    r = one.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=200,
                             temperature=0, background=True)
    assert r.background is True and r.status == "queued" and r.output == []
    done, seen = _polled(two, r.id)
    assert seen <= {"queued", "in_progress", done.status}
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text and done.usage is not None and done.usage.output_tokens > 0
    # The same as the foreground reply to the same body (greedy): one renderer.
    fg = one.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=200,
                              temperature=0)
    assert fg.output_text == done.output_text
    # A finished response cannot be cancelled; nor can one that was not in the background.
    with pytest.raises(openai.BadRequestError):
        two.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError) as fg_cancel:
        one.responses.cancel(fg.id)
    assert fg_cancel.value.body["code"] == "not_background"  # type: ignore[index]
    # Bound to its tenant, as the rest.
    with pytest.raises(openai.NotFoundError):
        client(stack, 1, STRANGER).responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client(stack, 0, STRANGER).responses.cancel(r.id)


def test_background_needs_store(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack, 0, OWNER).responses.create(model=MODEL, input="x", background=True,
                                           store=False)
    assert refused.value.body["param"] == "store"  # type: ignore[index]


def test_cancel_from_the_other_replica(stack: Stack) -> None:
    one, two = client(stack, 0, OWNER), client(stack, 1, OWNER)
    r = one.responses.create(model=MODEL, input="Count forever", max_output_tokens=450,
                             temperature=0, background=True)
    cancelled = two.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "cancelled"
    assert one.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        one.responses.cancel(r.id)


def test_a_background_stream_left_and_resumed_on_the_other_replica(stack: Stack) -> None:
    one, two = client(stack, 0, OWNER), client(stack, 1, OWNER)
    first: list[Any] = []
    with one.responses.create(model=MODEL, input="Go on", max_output_tokens=60,
                              temperature=0, background=True, stream=True) as events:
        for event in events:
            first.append(event)
            if len(first) == 5:
                break  # the client leaves: a background response runs on
    assert [e.sequence_number for e in first] == list(range(5))
    response_id = first[0].response.id
    assert first[0].response.background is True
    rest = list(two.responses.retrieve(response_id, stream=True, starting_after=4))
    assert [e.sequence_number for e in rest] == list(range(5, 5 + len(rest)))
    final = rest[-1].response
    assert final.status in ("completed", "incomplete")
    deltas = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    done, _ = _polled(two, response_id)
    assert done.output_text == final.output_text


def test_it_ends_though_the_admitting_replica_died(stack: Stack) -> None:
    """Last: it kills replica 0. The stored response still ends, derived on replica 1 from
    the request's result stream; and a conversation replica 0 answered goes on on replica 1."""
    one, two = client(stack, 0, OWNER), client(stack, 1, OWNER)
    turn = one.responses.create(model=MODEL, input="First turn", max_output_tokens=5,
                                temperature=0)
    r = one.responses.create(model=MODEL, input="A long tale", max_output_tokens=450,
                             temperature=0, background=True)
    # The worker is frozen while replica 0 dies, so the response has not ended by then,
    # however fast the machine (it had once ended before the first poll below).
    stack.worker_proc(0).send_signal(signal.SIGSTOP)
    try:
        stack.replica_proc(0).kill()
        stack.replica_proc(0).wait(10)
        unended = two.responses.retrieve(r.id).status
    finally:
        stack.worker_proc(0).send_signal(signal.SIGCONT)
    assert unended not in ENDED, unended
    # The turn replica 0 stored is the conversation replica 1 goes on with.
    follow = two.responses.create(model=MODEL, input="Second turn", max_output_tokens=5,
                                  temperature=0, previous_response_id=turn.id)
    assert follow.status in ("completed", "incomplete")
    items = two.responses.input_items.list(follow.id, order="asc").data
    texts = [(i.role, "".join(c.text for c in i.content))  # type: ignore[union-attr]
             for i in items]
    assert texts == [("user", "First turn"), ("assistant", turn.output_text),
                     ("user", "Second turn")], texts
    # It had not ended when its replica died: its end is derived, not stored by replica 0.
    done, _ = _polled(two, r.id, timeout=60)
    # Rendered from the record: the worker ran it to its end (the replica's death is no error
    # of the request's).
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.usage is not None and done.usage.output_tokens > 0 and done.output
    stored = httpx.get(f"{stack.url(1)}/v1/responses/{r.id}",
                       headers={"Authorization": f"Bearer {OWNER}"}, timeout=30)
    assert stored.json()["status"] == done.status
