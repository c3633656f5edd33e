"""Grammar-constrained rows in the worker's engine, on the tiny Llama with SmolLM2's real
tokenizer (whose random weights would never write JSON on their own).

A constrained request's output always follows its grammar and ends ("stop") when the grammar
is complete; its unconstrained neighbours in the batch decode exactly as they do alone; a
preempted request keeps its matcher, and a request resumed from published tokens replays them
into a fresh one, so both still end in a valid document (one whose tokens already complete it
ends at once); tokens that leave the grammar, or a grammar that does not compile, refuse the
request with `invalid_grammar`; `min_tokens` keeps stop tokens out until it is reached.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from shared import request_grammar as grammar
from shared.messages import GenerateRequest, SamplingParams
from worker.engine.checkpoint import Checkpoint
from worker.engine.constraint import Constraints, tokenizer_view
from worker.engine.engine import AdmissionError, Engine, EngineConfig
from worker.engine.kv_cache import KVPool
from worker.engine.model_runner import ModelRunner

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "tags"],
          "properties": {"ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "minItems": 12, "maxItems": 12}}}
BALLOT = grammar.from_json_schema(SCHEMA)
PROMPT = [1, 9690, 198, 30, 40, 2]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()


@pytest.fixture(scope="module")
def constraints(tiny_model: Path, model: PreTrainedModel) -> Constraints:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    return Constraints(tokenizer_view(tiny_model, model.config.vocab_size,
                                      (tokenizer.eos_token_id,)))


def test_the_workers_view_of_the_tokenizer_is_transformers_own(tiny_model: Path) -> None:
    """The worker reads `tokenizer.json` itself (no transformers import at start); the replica
    checks grammars with a view of transformers' tokenizer: the two agree on every token."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    eos = (tokenizer.eos_token_id,)
    ours = tokenizer_view(tiny_model, len(tokenizer), eos)
    theirs = grammar.tokenizer_view(tokenizer, len(tokenizer), eos)
    assert ours.vocab_size == theirs.vocab_size == len(tokenizer)
    assert ours.eos_token == theirs.eos_token
    every = list(range(len(tokenizer)))
    assert [ours.decode_bytes([i]) for i in every] == [theirs.decode_bytes([i]) for i in every]
    text = "Hello, world! {\"ok\": true} <|im_start|>user\n  indented\tnaïve 😀 12345"
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert ours.is_special_token(eos[0]) and theirs.is_special_token(eos[0])


@pytest.fixture(scope="module")
def decode(tiny_model: Path):  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _engine(model: PreTrainedModel, constraints: Constraints | None, pages: int = 256) -> Engine:
    runner = ModelRunner(Checkpoint.of(model), page_size=4)
    config = EngineConfig(max_running=8, max_step_tokens=64, max_model_len=512, page_size=4)
    return Engine(runner, KVPool(runner.kv_shape, pages, 4), config, eos_token_ids=(2,),
                  constraints=constraints)


def _request(i: int, constrained: bool, max_tokens: int = 200,
             **params: object) -> GenerateRequest:
    params.setdefault("temperature", 1.0)
    params.setdefault("seed", i)
    return GenerateRequest(
        id=f"c-{i}", model="m", prompt_ids=(*PROMPT, 100 + i), created=0.0,
        queue_deadline=0.0, deadline=0.0, grammar=BALLOT if constrained else None,
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
    )


def _run(engine: Engine, requests: list[GenerateRequest],
         generated: dict[str, tuple[int, ...]] | None = None
         ) -> dict[str, tuple[list[int], str | None]]:
    out: dict[str, tuple[list[int], str | None]] = {}
    for req in requests:
        finish = engine.add(req, (generated or {}).get(req.id, ()))
        out[req.id] = (list((generated or {}).get(req.id, ())), finish)
    while engine.scheduler.has_work():
        for o in engine.step():
            tokens, _ = out[o.request_id]
            if o.token is not None:
                tokens.append(o.token)
            out[o.request_id] = (tokens, o.error or o.finish)
    return out


def _valid(text: str) -> bool:
    doc = orjson.loads(text)
    return (isinstance(doc["ok"], bool) and len(doc["tags"]) == 12
            and set(doc["tags"]) <= {"red", "green", "blue"})


def test_constrained_rows_follow_the_grammar_and_leave_their_neighbours_alone(
    model: PreTrainedModel, constraints: Constraints, decode
) -> None:  # type: ignore[no-untyped-def]
    mixed = _run(_engine(model, constraints), [_request(i, i % 2 == 0) for i in range(6)])
    for i in range(0, 6, 2):
        tokens, finish = mixed[f"c-{i}"]
        assert finish == "stop" and _valid(decode(tokens))
    alone = _run(_engine(model, constraints), [_request(i, False) for i in (1, 3, 5)])
    for i in (1, 3, 5):  # seeded draws: the same tokens whatever shares the batch
        assert mixed[f"c-{i}"] == alone[f"c-{i}"]


def test_preempted_and_resumed_requests_still_end_valid(
    model: PreTrainedModel, constraints: Constraints, decode
) -> None:  # type: ignore[no-untyped-def]
    tight = _engine(model, constraints, pages=40)  # too few pages for 6 at once
    out = _run(tight, [_request(i, True, max_tokens=100) for i in range(6)])
    assert tight.scheduler.num_preempted > 0
    assert all(f == "stop" and _valid(decode(t)) for t, f in out.values())
    # Resumed on another engine from the first 15 tokens a worker had published.
    whole, _ = out["c-0"]
    resumed = _run(_engine(model, constraints), [_request(0, True, max_tokens=100)],
                   {"c-0": tuple(whole[:15])})
    tokens, finish = resumed["c-0"]
    assert finish == "stop" and tokens[:15] == whole[:15] and _valid(decode(tokens))
    # Every token was published, only the finish entry lost: it ends at once, queued nowhere.
    ended = _engine(model, constraints)
    assert ended.add(_request(0, True, max_tokens=100), tuple(whole)) == "stop"
    assert not ended.scheduler.has_work()


def test_tokens_off_the_grammar_or_a_bad_grammar_are_refused(
    model: PreTrainedModel, constraints: Constraints
) -> None:
    engine = _engine(model, constraints)
    with pytest.raises(AdmissionError) as off:
        engine.add(_request(0, True), generated=(100, 101, 102))  # not "{..."
    assert off.value.code == "invalid_grammar"
    bad = _request(1, False).model_copy(update={"grammar": grammar.from_regex("((")})
    with pytest.raises(AdmissionError) as broken:
        engine.add(bad)
    assert broken.value.code == "invalid_grammar"
    with pytest.raises(AdmissionError, match="constrained"):
        _engine(model, None).add(_request(2, True))
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_a_grammar_that_breaks_its_limits_mid_way_fails_its_request_alone(
    model: PreTrainedModel, constraints: Constraints
) -> None:
    # Nests itself without end ({"x":{"x":...): the parser's per-step limits stop it at its
    # first token. (The replica refuses this one before queueing; others may fail later.)
    nesting = grammar.from_json_schema({"type": "object", "properties": {"x": {"$ref": "#"}},
                                        "required": ["x"]})
    bad = _request(0, False, max_tokens=20).model_copy(update={"grammar": nesting})
    engine = _engine(model, constraints)
    errors = {}
    engine.add(bad)
    engine.add(_request(1, True, max_tokens=100))
    while engine.scheduler.has_work():
        for o in engine.step():
            if o.error is not None:
                errors[o.request_id] = o.error
            elif o.finish is not None:
                assert o.request_id == "c-1" and o.finish == "stop"
    [(request_id, error)] = errors.items()
    assert request_id == "c-0" and error.code == "invalid_grammar", error
    assert "Too many items" in error.message and "<non-verbose/>" not in error.message


def test_min_tokens_holds_off_stop_tokens(model: PreTrainedModel) -> None:
    engine = _engine(model, None)
    probe = _run(engine, [_request(0, False, max_tokens=30, temperature=0.0)])
    tokens, _ = probe["c-0"]
    stop = tokens[3]  # a token greedy decoding writes early: make it a stop token
    first = tokens.index(stop)
    early = _run(engine, [_request(0, False, max_tokens=30, temperature=0.0,
                                   stop_token_ids=(stop,))])
    held = _run(engine, [_request(0, False, max_tokens=30, temperature=0.0,
                                  stop_token_ids=(stop,), min_tokens=first + 5)])
    assert early["c-0"] == (tokens[:first], "stop")
    held_tokens, _ = held["c-0"]
    assert len(held_tokens) >= first + 5 and stop not in held_tokens[: first + 5]
