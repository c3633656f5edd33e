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
from ops.supervisor import Backoff, ChildSpec, Supervisor
from ops.testkit.probe import wait_healthy
from ops.up import serves_all
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


@pytest.mark.parametrize(("env", "flags", "named"), [
    ({"REDSERVE_MAX_RUNNING": "0"}, [], "REDSERVE_MAX_RUNNING"),
    ({}, ["--page-size", "0"], "--page-size"),
    ({"REDSERVE_MAX_QUEUED_REQUESTS": "0"}, [], "REDSERVE_MAX_QUEUED_REQUESTS"),
])
def test_up_refuses_a_bad_setting_of_either_side_before_starting_anything(
        env: dict[str, str], flags: list[str], named: str) -> None:
    """A worker's setting as much as a replica's: one line naming it and exit 2, before Redis
    or any child starts (not a worker failing over and over under the supervisor)."""
    done = subprocess.run([sys.executable, "-m", "ops.cli", "up", *flags], capture_output=True,
                          text=True, env={**child_env(None, "rs"), **env}, timeout=60)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and f"invalid {named}" in said, said
    assert "embedded" not in said and "ready" not in said, said


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
    tiny_model: Path, tmp_path: Path, how: str, replicas: int, workers: int
) -> None:
    port = free_port()
    while any(_in_use(port + i) for i in range(replicas)):
        port = free_port()
    # No REDIS_URL: `up` must start its own Valkey. Its output goes to a file, not a pipe
    # that nobody reads until the end: a full pipe would stop every process of the stack.
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--model",
             str(tiny_model), "--served-model-name", "tiny", "--replicas", str(replicas),
             "--workers", str(workers)],
            env=_without_auth_choice(child_env(None, "rsup")), start_new_session=True,
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, log.read_text()
            try:
                if all(httpx.get(f"http://127.0.0.1:{port + i}/health", timeout=1).status_code
                       == 200 for i in range(replicas)):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"redserve up never became healthy; its output:\n{log.read_text()}")
            time.sleep(0.25)
        for i in range(replicas):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port + i}/v1", api_key="x")
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
        assert eventually(lambda: httpx.get(f"http://127.0.0.1:{port}/ready").json()
                          .get("workers") == workers, 30)
        # up, valkey, the replicas, the workers (counted once the workers serve: while one
        # starts, its kernels' smoke test runs in a process of its own, worker/engine/smoke.py)
        assert len(_session_members(up.pid)) == 2 + replicas + workers

        if how == "ctrl-c":
            os.killpg(up.pid, signal.SIGINT)  # a terminal sends it to the whole group
        else:
            up.send_signal(signal.SIGTERM)  # an init system signals the parent only
        assert up.wait(60) == 0
        # No key and a loopback address: authentication is off, and `up` says so.
        assert "authentication is off" in " ".join(log.read_text().split())
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


def test_backoff_doubles_to_a_cap_starts_over_after_a_good_run_and_spots_a_failing_child(
) -> None:
    policy = Backoff(initial_s=0.5, cap_s=10.0, reset_after_s=30.0, failing_after=5)
    failures, delays = 0, []
    for _ in range(7):
        failures, delay = policy.after_exit(failures, ran_s=12.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert failures == 7 and policy.keeps_failing(failures)
    assert not policy.keeps_failing(4)
    # A child that stayed up past reset_after_s starts from the first delay again.
    assert policy.after_exit(failures, ran_s=31.0) == (1, 0.5)
    assert policy.after_exit(10_000, ran_s=1.0) == (10_001, 10.0)  # hours of failing: no overflow


def test_supervisor_restarts_what_exits_says_so_and_stops_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    crash = (sys.executable, "-c", "import sys; sys.exit(3)")
    sleep = (sys.executable, "-c", "import time; time.sleep(60)")
    supervisor = Supervisor(
        [ChildSpec("crasher", crash), ChildSpec("sleeper", sleep)], os.environ,
        Backoff(initial_s=0.01, cap_s=0.05, failing_after=3))
    supervisor.start()
    sleeper = supervisor.children[1].proc
    try:
        assert eventually(lambda: supervisor.poll() or supervisor.children[0].restarts >= 4, 20)
        said = caplog.messages
        assert all(line.startswith("crasher exited with code 3") for line in said[:2])
        assert "crasher keeps failing" in said[2] and "3 times in a row" in said[2]
        fields = [vars(r)["fields"] for r in caplog.records[:3]]
        assert [f["event"] for f in fields] == ["child.exited", "child.exited", "child.failing"]
        assert all(f["child"] == "crasher" and f["exit_code"] == 3 for f in fields)
        assert sleeper is not None
        os.kill(sleeper.pid, signal.SIGKILL)
        assert eventually(lambda: supervisor.poll() or supervisor.children[1].restarts == 1, 10)
        assert any("sleeper killed by SIGKILL" in line for line in caplog.messages)
        assert supervisor.children[1].proc is not sleeper
    finally:
        supervisor.stop(grace=5)
    pids = [c.proc.pid for c in supervisor.children if c.proc is not None]
    supervisor.poll()  # stopping: nothing comes back
    assert [c.proc.pid for c in supervisor.children if c.proc is not None] == pids
    assert all(c.proc is not None and c.proc.poll() is not None for c in supervisor.children)


def test_ready_needs_a_live_worker_for_every_model() -> None:
    assert serves_all({"status": "ok", "workers": 2, "models": {"a": 1, "b": 1}}, ["a", "b"])
    assert not serves_all({"status": "ok", "workers": 1, "models": {"a": 1, "b": 0}},
                          ["a", "b"])
    assert not serves_all({"status": "ok", "workers": 1, "models": {"a": 1}}, ["a", "b"])
    assert not serves_all({"status": "draining"}, ["a"])
    assert not serves_all({"status": "ok", "workers": 1}, ["a"])  # a replica without "models"
    assert not serves_all([], ["a"])


def test_several_models_where_one_is_meant_is_refused_clearly(tmp_path: Path) -> None:
    env = child_env("redis://127.0.0.1:1", "rs")
    cli = [sys.executable, "-m", "ops.cli"]
    worker = subprocess.run([*cli, "worker", "--model", "a=/x", "--model", "b=/y"],
                            capture_output=True, text=True, env=env, timeout=60)
    said = " ".join(worker.stderr.split())
    assert worker.returncode == 2 and "a worker serves exactly one model" in said, said
    models = tmp_path / "models.txt"
    models.write_text("# two models\na=/x\nb=/y  # the second\n")
    for command in (["api"], ["up"]):
        named = subprocess.run([*cli, *command, "--models-file", str(models),
                                "--served-model-name", "one"],
                               capture_output=True, text=True, env=env, timeout=60)
        said = " ".join(named.stderr.split())
        assert named.returncode == 2 and "--served-model-name names a single model" in said, said


def _children(ppid: int) -> dict[int, list[str]]:
    """pid -> command line of each live child of `ppid`."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == ppid and fields[0] != "Z":
            found[int(stat.parent.name)] = argv
    return found


def _api(ppid: int) -> tuple[int, int] | None:
    """(pid, port) of the running `redserve api` child of `ppid`."""
    for pid, argv in _children(ppid).items():
        if "ops.cli" in argv and "api" in argv:
            return pid, int(argv[argv.index("--port") + 1])
    return None


def _workers(ppid: int) -> dict[int, tuple[str, str]]:
    """pid -> (--name, --served-model-name) of each running `redserve worker` child."""
    return {pid: (argv[argv.index("--name") + 1], argv[argv.index("--served-model-name") + 1])
            for pid, argv in _children(ppid).items() if "ops.cli" in argv and "worker" in argv}


def test_up_restarts_a_killed_worker_and_replica_and_serves_again(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    models = tmp_path / "models.txt"
    models.write_text(f"b={tiny_model}\n")
    with log.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--port", str(port),
             "--model", f"a={tiny_model}", "--models-file", str(models)],
            # Wide enough that rich wraps no line of the log.
            env=child_env(None, "rsup", REDSERVE_HEARTBEAT_TTL_S="2", COLUMNS="300"),
            start_new_session=True, stdout=out, stderr=subprocess.STDOUT)

    def said() -> str:
        return " ".join(log.read_text().split())

    def completes(model: str) -> bool:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": model, "prompt": "hello", "max_tokens": 4})
        return reply.status_code == 200

    try:
        assert eventually(lambda: up.poll() is not None
                          or f"ready: http://127.0.0.1:{port}/v1 (models a, b;" in said(), 120), \
            said()
        assert up.poll() is None, said()
        assert len(_children(up.pid)) == 4  # valkey, a worker per model, the replica
        # A worker and the replica die (OOM killer, segfault): `up` stays, says so, and starts
        # them again, the worker under the same name, the replica on the same port.
        before = _workers(up.pid)
        assert len(before) == 2 and len(set(before.values())) == 2
        worker, (name, model) = next(iter(before.items()))
        api = _api(up.pid)
        assert api is not None and api[1] == port
        os.kill(worker, signal.SIGKILL)
        os.kill(api[0], signal.SIGKILL)
        lines = (f"worker {name} ({model}) killed by SIGKILL",
                 f"API replica :{port} killed by SIGKILL")
        assert eventually(lambda: all(line in said() for line in lines), 10), said()
        assert said().count("restarting in 0.5s") == 2
        assert eventually(lambda: sorted(_workers(up.pid).values()) == sorted(before.values())
                          and worker not in _workers(up.pid), 20), said()
        assert eventually(lambda: (again := _api(up.pid)) is not None and again[0] != api[0]
                          and again[1] == port, 10), said()
        assert wait_healthy(f"http://127.0.0.1:{port}", lambda: up.poll() is None, 30), said()
        assert completes("a") and completes("b"), said()
        assert up.poll() is None

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, said()
        assert eventually(lambda: not _session_members(up.pid), 10)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
