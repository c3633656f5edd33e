"""`redserve up`: the whole system from one command, stopped cleanly by Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ops.embedded_redis import free_port
from tests.stack import child_env, eventually


def _session_members(sid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields[0] is the state, fields[3] the session id; zombies are already gone for us.
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_help_explains_every_command() -> None:
    for command in ([], ["up"], ["api"], ["worker"]):
        out = subprocess.run([sys.executable, "-m", "ops.cli", *command, "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "usage: redserve" in out
    worker_help = subprocess.run([sys.executable, "-m", "ops.cli", "worker", "--help"],
                                 capture_output=True, text=True, check=True).stdout
    for option in ("--model", "--device", "--max-running", "--kv-cache-memory", "--page-size",
                   "--max-prefill-tokens", "--name"):
        assert option in worker_help


def test_api_without_redis_url_refuses_to_start() -> None:
    result = subprocess.run([sys.executable, "-m", "ops.cli", "api"], capture_output=True,
                            text=True, env=child_env(None, "rs"), timeout=60)
    assert result.returncode == 2 and "REDIS_URL" in result.stderr


def _without_auth_choice(env: dict[str, str]) -> dict[str, str]:
    """The environment of a user who has said nothing about authentication."""
    return {k: v for k, v in env.items() if k not in ("REDSERVE_NO_AUTH", "REDSERVE_API_KEYS")}


def test_without_keys_a_replica_refuses_to_start_unless_told_to_serve_openly() -> None:
    env = {**_without_auth_choice(child_env("redis://127.0.0.1:1", "rs"))}
    api = subprocess.run([sys.executable, "-m", "ops.cli", "api"], capture_output=True,
                         text=True, env=env, timeout=60)
    said = " ".join(api.stderr.split())  # rich wraps lines
    assert api.returncode == 2 and "REDSERVE_API_KEYS" in said and "REDSERVE_NO_AUTH" in said
    # `up` on an address other machines can reach: keys or an explicit --no-auth.
    up = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--host", "0.0.0.0"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert up.returncode == 2 and "--no-auth" in up.stderr, up.stderr
    bad = subprocess.run([sys.executable, "-m", "ops.cli", "up"], capture_output=True,
                         text=True, env={**env, "REDSERVE_API_KEYS": "team:short"}, timeout=60)
    assert bad.returncode == 2 and "at least 8 characters" in " ".join(bad.stderr.split())


@pytest.mark.parametrize(("how", "replicas", "workers"), [("ctrl-c", 1, 1), ("sigterm", 2, 2)])
def test_up_serves_with_embedded_redis_and_stops_leaving_nothing(
    tiny_model: Path, how: str, replicas: int, workers: int
) -> None:
    port = free_port()
    while any(_in_use(port + i) for i in range(replicas)):
        port = free_port()
    # No REDIS_URL: `up` must start its own Valkey.
    up = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--model", str(tiny_model),
         "--served-model-name", "tiny", "--replicas", str(replicas), "--workers", str(workers)],
        env=_without_auth_choice(child_env(None, "rsup")), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, up.stdout.read().decode() if up.stdout else ""
            try:
                if all(httpx.get(f"http://127.0.0.1:{port + i}/health", timeout=1).status_code
                       == 200 for i in range(replicas)):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "redserve up never became healthy"
            time.sleep(0.25)
        # up, valkey, the replicas, the workers
        assert len(_session_members(up.pid)) == 2 + replicas + workers
        for i in range(replicas):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port + i}/v1", api_key="x")
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
        assert eventually(lambda: httpx.get(f"http://127.0.0.1:{port}/ready").json()
                          .get("workers") == workers, 30)

        if how == "ctrl-c":
            os.killpg(up.pid, signal.SIGINT)  # a terminal sends it to the whole group
        else:
            up.send_signal(signal.SIGTERM)  # an init system signals the parent only
        assert up.wait(60) == 0
        # No key and a loopback address: authentication is off, and `up` says so.
        assert up.stdout is not None
        assert "authentication is off" in " ".join(up.stdout.read().decode().split())
        deadline = time.monotonic() + 10
        while _session_members(up.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session_members(up.pid) == []
        for i in range(replicas):
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port + i}/health", timeout=1)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
