"""Redis Cluster: every key of one request, and its replica's feed, share one slot; so do a
model's queue, request stream and live-worker set."""

from __future__ import annotations

from redis.crc import key_slot

from shared.keys import Keys, new_replica_tag, new_request_id, replica_of


def test_request_keys_share_the_replica_slot() -> None:
    keys = Keys("rs")
    replica = new_replica_tag()
    ids = [new_request_id(replica) for _ in range(50)]
    assert len(set(ids)) == 50
    slots = {key_slot(keys.feed(replica).encode())}
    for rid in ids:
        assert replica_of(rid) == replica
        for key in (keys.state(rid), keys.out(rid), keys.abort(rid)):
            slots.add(key_slot(key.encode()))
    assert len(slots) == 1


def test_replicas_get_distinct_tags() -> None:
    assert len({new_replica_tag() for _ in range(100)}) == 100


def test_a_models_keys_share_a_slot() -> None:
    keys = Keys("rs")
    for model in ("SmolLM2-135M-Instruct", "meta-llama/Llama-3.1-8B", "a"):
        slots = {key_slot(k.encode()) for k in (keys.requests(model), keys.queued(model),
                                                  keys.workers(model), keys.entries(model),
                                                  keys.service(model))}
        assert len(slots) == 1
