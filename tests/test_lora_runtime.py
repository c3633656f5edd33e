"""LoRA adapters loaded and unloaded at run time (`POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), limited per tenant, counted per adapter: two real replicas and a
worker on real Redis, the official `openai` client.

An adapter loaded on one replica is listed by the other (which looks a name it does not know up
in the registry at once, and lists it after its next refresh); unloaded, new requests naming it
are 404 `model_not_found`. The endpoints are off unless allowed, and only an admin tenant may
call them; a bad adapter is a 400 naming its problem. A tenant limited to named adapters sees
any other exactly as a name that does not exist. Generation runs only on the adapter declared
with `--lora` on the replicas and the worker (`alpha`): a runtime adapter's is the worker's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import PreTrainedModel

from tests.lora_adapters import ALL, make_adapter
from tests.stack import Stack, eventually

BASE = "tiny-llama"
KEYS = {"ops": "sk-ops-0123456789", "acme": "sk-acme-0123456789",
        "zed": "sk-zed-0123456789"}
# The registry's refresh (api/queue/loras.py LORA_REFRESH_S), with room for a slow machine.
REFRESH_WAIT_S = 15.0


@pytest.fixture(scope="module")
def adapters(tiny_base_model: PreTrainedModel,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_base_model  # the session's (make_adapter copies it)
    root = tmp_path_factory.mktemp("runtime-loras")
    return {"alpha": make_adapter(base, root / "alpha", ALL, seed=1),
            "beta": make_adapter(base, root / "beta", ["q_proj", "v_proj"], seed=2),
            "gamma": make_adapter(base, root / "gamma", ["o_proj"], seed=3),
            "wide": make_adapter(base, root / "wide", ["q_proj"], rank=32, seed=4)}


@pytest.fixture(scope="module")
def stack(redis_url: str, tiny_model: Path, adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tenants = tmp_path_factory.mktemp("runtime-tenants") / "tenants.toml"
    tenants.write_text('[tenants.ops]\nadmin = true\n\n[tenants.acme]\nadapters = ["alpha"]\n')
    stack = Stack(redis_url, tiny_model, served_name=BASE, replicas=2, env={
        "REDSERVE_DTYPE": "float32", "REDSERVE_LORA": f"alpha={adapters['alpha']}",
        "REDSERVE_ALLOW_RUNTIME_LORA": "true", "REDSERVE_TENANTS_FILE": str(tenants),
        "REDSERVE_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items())}).start()
    yield stack
    stack.stop()


def client(stack: Stack, tenant: str, replica: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url(replica)}/v1", api_key=KEYS[tenant],
                         max_retries=0)


def load(c: openai.OpenAI, name: str, path: Path | str) -> str:
    return c.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)},
                  cast_to=str)


def unload(c: openai.OpenAI, name: str) -> str:
    return c.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=str)


def ids(c: openai.OpenAI) -> set[str]:
    return {m.id for m in c.models.list().data}


def tokenize(stack: Stack, tenant: str, model: str, replica: int = 0) -> httpx.Response:
    return httpx.post(f"{stack.url(replica)}/tokenize", json={"model": model, "prompt": "hi"},
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=10)


def error(e: openai.APIStatusError) -> dict[str, Any]:
    body: dict[str, Any] = e.response.json()["error"]
    return body


def test_off_by_default(redis_url: str, tiny_model: Path, adapters: dict[str, Path]) -> None:
    off = Stack(redis_url, tiny_model, served_name=BASE, workers=0).start()
    try:
        c = openai.OpenAI(base_url=f"{off.base_url}/v1", api_key="x", max_retries=0)
        for call in (lambda: load(c, "beta", adapters["beta"]), lambda: unload(c, "beta")):
            with pytest.raises(openai.NotFoundError) as refused:
                call()
            assert "--allow-runtime-lora" in error(refused.value)["message"]
            assert "REDSERVE_ALLOW_RUNTIME_LORA=true" in error(refused.value)["message"]
    finally:
        off.stop()


def test_loaded_on_one_replica_listed_on_both_then_unloaded(
        stack: Stack, adapters: dict[str, Path]) -> None:
    ops0, ops1 = client(stack, "ops", 0), client(stack, "ops", 1)
    assert ids(ops0) == ids(ops1) == {BASE, "alpha"}
    assert load(ops0, "beta", adapters["beta"]) == \
        "Success: LoRA adapter 'beta' added successfully."
    # The other replica knows it at once (a name it does not know is looked up)...
    assert tokenize(stack, "ops", "beta", replica=1).status_code == 200
    # ...and lists it, with its base and directory, as it lists a declared one.
    assert eventually(lambda: "beta" in ids(ops1), REFRESH_WAIT_S)
    for c in (ops0, ops1):
        cards = {m.id: m.model_dump() for m in c.models.list().data}
        assert (cards["beta"]["parent"], cards["beta"]["root"]) == (BASE, str(adapters["beta"]))
        assert (cards["alpha"]["parent"], cards["alpha"]["root"]) == \
            (BASE, str(adapters["alpha"]))
    # Unloaded on the second replica: its new requests are 404 at once, the first's after
    # its next refresh.
    assert unload(ops1, "beta") == "Success: LoRA adapter 'beta' removed successfully."
    with pytest.raises(openai.NotFoundError) as gone:
        ops1.completions.create(model="beta", prompt="hi", max_tokens=2)
    assert gone.value.code == "model_not_found"
    assert eventually(lambda: "beta" not in ids(ops0), REFRESH_WAIT_S)
    assert tokenize(stack, "ops", "beta", replica=0).status_code == 404
    with pytest.raises(openai.NotFoundError) as again:
        unload(ops0, "beta")
    assert "cannot be found" in error(again.value)["message"]


def test_a_bad_adapter_or_name_is_a_400_naming_the_problem(
        stack: Stack, adapters: dict[str, Path], tmp_path: Path) -> None:
    ops = client(stack, "ops")
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text(
        (adapters["beta"] / "adapter_config.json").read_text())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"lora_name": "half", "lora_path": str(half)}, "missing file adapter_model.safetensors"),
        ({"lora_name": "wide", "lora_path": str(adapters["wide"])},
         "rank 32 is over --max-lora-rank 16"),
        ({"lora_name": "rel", "lora_path": "loras/beta"}, "not an absolute path"),
        ({"lora_name": "a b", "lora_path": str(adapters["beta"])}, "bad adapter name"),
        ({"lora_name": "alpha", "lora_path": str(adapters["beta"])}, "already in use"),
        ({"lora_name": BASE, "lora_path": str(adapters["beta"])}, "already in use"),
        ({"lora_name": "beta"}, "lora_path"),
        ({"lora_name": "beta", "lora_path": str(adapters["beta"]), "load_inplace": True},
         "unload it, then load it again"),
    ]
    for body, problem in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            ops.post("/load_lora_adapter", body=body, cast_to=str)
        assert problem in error(bad.value)["message"], body
    with pytest.raises(openai.BadRequestError) as declared:
        unload(ops, "alpha")
    assert "declared with --lora" in error(declared.value)["message"]
    # A name loaded twice, through either replica: the registry holds one.
    load(ops, "gamma", adapters["gamma"])
    try:
        with pytest.raises(openai.BadRequestError) as twice:
            load(client(stack, "ops", 1), "gamma", adapters["gamma"])
        assert "already in use" in error(twice.value)["message"]
    finally:
        unload(ops, "gamma")


def test_only_an_admin_tenant_may_load_or_unload(stack: Stack,
                                                 adapters: dict[str, Path]) -> None:
    for tenant in ("acme", "zed"):
        with pytest.raises(openai.PermissionDeniedError) as refused:
            load(client(stack, tenant), "beta", adapters["beta"])
        assert "admin = true" in error(refused.value)["message"]
        with pytest.raises(openai.PermissionDeniedError):
            unload(client(stack, tenant), "alpha")
    assert "beta" not in ids(client(stack, "ops"))


def test_a_tenant_limited_to_named_adapters_sees_no_other(stack: Stack,
                                                          adapters: dict[str, Path]) -> None:
    ops, acme, zed = client(stack, "ops"), client(stack, "acme"), client(stack, "zed")
    load(ops, "gamma", adapters["gamma"])
    try:
        assert ids(zed) == {BASE, "alpha", "gamma"}
        assert ids(acme) == {BASE, "alpha"}
        refusals = []
        for model in ("gamma", "nonesuch"):
            with pytest.raises(openai.NotFoundError) as hidden:
                acme.chat.completions.create(model=model, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
            refusals.append(error(hidden.value))
        # The same answer as for a name that does not exist, and it lists nothing hidden.
        assert json.dumps(refusals[0]).replace("gamma", "X") == \
            json.dumps(refusals[1]).replace("nonesuch", "X")
        assert "'gamma'" not in refusals[1]["message"]
        assert tokenize(stack, "acme", "gamma").status_code == 404
        # Its own adapter and the base model serve it.
        for model in ("alpha", BASE):
            reply = acme.completions.create(model=model, prompt="hi", max_tokens=3,
                                            temperature=0)
            assert reply.model == model
    finally:
        unload(ops, "gamma")


def test_requests_and_output_tokens_are_counted_per_adapter(stack: Stack,
                                                            adapters: dict[str, Path]) -> None:
    url = f"{stack.url(1)}/metrics"
    c = client(stack, "zed", 1)

    def counts(name: str) -> tuple[float, float]:
        samples = stack.metrics(url)
        labels = f'{{adapter="{name}",model="{BASE}"}}'
        return (samples.get(f"redserve_api_adapter_requests_total{labels}", 0.0),
                samples.get(f"redserve_api_adapter_output_tokens_total{labels}", 0.0))

    before = {name: counts(name) for name in (BASE, "alpha")}
    for model, n in ((BASE, 4), ("alpha", 5), ("alpha", 6)):
        c.completions.create(model=model, prompt="hi", max_tokens=n, temperature=0,
                             extra_body={"ignore_eos": True})
    assert counts(BASE) == (before[BASE][0] + 1, before[BASE][1] + 4)
    assert counts("alpha") == (before["alpha"][0] + 2, before["alpha"][1] + 11)
    # A runtime adapter is counted while it is loaded, and its series goes with it: the
    # label's values are bounded by what is loaded.
    load(client(stack, "ops"), "beta", adapters["beta"])
    try:  # accepted and queued; a worker that loads only declared adapters refuses it
        c.completions.create(model="beta", prompt="hi", max_tokens=2)
    except openai.APIStatusError as e:
        assert "does not exist" not in error(e)["message"]  # not the replica's 404
    assert counts("beta")[0] == 1
    unload(client(stack, "ops"), "beta")
    assert eventually(lambda: "beta" not in ids(c), REFRESH_WAIT_S)
    assert not any('adapter="beta"' in name for name in stack.metrics(url))
