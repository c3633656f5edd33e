"""Logs as an operator reads them: with `--log-format json` every line any process of the
system writes (uvicorn's own, the supervisor's, a refused start's) is one JSON object; no
per-request access log unless asked for; no prompt or output text unless asked for; text mode
shows an event's fields as key=value on plain lines."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai

from ops.embedded_redis import free_port
from ops.testkit.probe import wait_healthy
from shared.logs import log_event, make_handler
from shared.settings import Settings
from tests.stack import child_env, eventually

# In every prompt below and, through `echo`, in a streamed reply: it must never reach a log.
SECRET = "zebra-quartz-4711"
REQUIRED = {"ts", "level", "logger", "msg"}
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
                       r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: ")


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line as a JSON object with the required keys and a UTC ISO 8601 `ts`."""
    records = []
    for line in text.splitlines():
        record = json.loads(line)  # raises on anything that is not JSON
        assert isinstance(record, dict) and REQUIRED <= record.keys(), line
        ts = datetime.fromisoformat(record["ts"].replace("Z", "+00:00"))
        assert ts.utcoffset() == timedelta(0), line
        records.append(record)
    return records


def _redserve(args: list[str], env: dict[str, str], tmp_path: Path
              ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`redserve <args>` with its stdout and stderr each in a file of its own."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "ops.cli", *args], env=env, stdout=o,
                                stderr=e, start_new_session=True)
    return proc, out, err


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def test_up_in_json_writes_only_json_without_access_log_or_request_text(
    redis_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    env = child_env(redis_url, f"rslog-{uuid.uuid4().hex[:8]}")
    # Debug: the most any library says, and still nothing but JSON and no request text.
    up, out, err = _redserve(["up", "--port", str(port), "--model", f"tiny={tiny_model}",
                              "--log-format", "json", "--log-level", "debug"], env, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        assert eventually(lambda: up.poll() is not None or '"up.ready"' in err.read_text(),
                          120), err.read_text()
        assert up.poll() is None, err.read_text()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"repeat {SECRET}"}],
            max_tokens=8)
        # `echo` puts the prompt into the streamed reply: output text carries the secret too.
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=f"echo {SECRET}", echo=True, max_tokens=8, stream=True))
        assert SECRET in streamed
        # Refused bodies holding the text: an unsupported field, and JSON cut short.
        refused = httpx.post(f"{base}/v1/completions",
                             json={"model": "tiny", "prompt": SECRET, "bogus": SECRET})
        broken = httpx.post(f"{base}/v1/completions", content=f'{{"prompt": "{SECRET}',
                            headers={"content-type": "application/json"})
        assert refused.status_code == broken.status_code == 400
        assert _stop(up) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    text = err.read_text()
    records = _json_lines(text)
    assert out.read_text() == ""
    loggers = {r["logger"] for r in records}
    # up, its supervisor's children and uvicorn itself, all through the one handler.
    assert {"redserve.up", "redserve.api", "redserve.worker", "uvicorn.error"} <= loggers
    assert any(r["msg"].startswith("Uvicorn running on") for r in records)
    [ready] = [r for r in records if r.get("event") == "up.ready"]
    # Each process says once, on one line, that it serves: `up`, the replica, the worker.
    said_ready = sorted(r["logger"] for r in records if r["msg"].startswith("ready: "))
    assert said_ready == ["redserve.api", "redserve.up", "redserve.worker"], said_ready
    assert "ready" in ready["msg"] and ready["models"] == ["tiny"]
    assert any(r.get("event") == "up.stopping" for r in records)
    # An event's fields are keys of its line.
    finished = {r.get("request_id") for r in records if r.get("event") == "request.finished"}
    assert chat.id.removeprefix("chatcmpl-") in finished
    # No access log by default.
    assert "uvicorn.access" not in loggers and "POST /v1/" not in text
    assert SECRET not in text


def test_access_log_and_request_text_when_asked_on_plain_text_lines(
    redis_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    # No worker: the request ends with queue_timeout after a second, its prompt logged first.
    env = child_env(redis_url, f"rslog-{uuid.uuid4().hex[:8]}", REDSERVE_QUEUE_TIMEOUT_S="1")
    api, _, err = _redserve(["api", "--host", "127.0.0.1", "--port", str(port), "--model",
                             f"tiny={tiny_model}", "--access-log", "--log-request-text"],
                            env, tmp_path)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", lambda: api.poll() is None, 120), \
            err.read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": SECRET}],
            "max_tokens": 2})
        assert reply.status_code == 503, reply.text
        assert _stop(api) == 0
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGKILL)
            api.wait()
    lines = err.read_text().splitlines()
    # Text on a pipe: one plain line a record, nothing wrapped, no terminal codes.
    assert lines and all(TEXT_LINE.match(line) for line in lines), lines
    assert any(re.search(r'uvicorn\.access: 127\.0\.0\.1:\d+ - "GET /health HTTP/1\.1" 200$',
                         line) for line in lines), lines
    # Asked for, the prompt is logged once, in its request.received event.
    [received] = [line for line in lines if SECRET in line]
    assert "request.received" in received and "tenant=anonymous" in received, received


def test_a_refused_start_is_a_json_line_too(tmp_path: Path) -> None:
    env = child_env(None, "rs")  # no REDIS_URL: the worker refuses to start
    done = subprocess.run([sys.executable, "-m", "ops.cli", "worker", "--log-format", "json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    [record] = _json_lines(done.stderr)
    assert record["level"] == "ERROR" and "REDIS_URL is not set" in record["msg"]


def test_transformers_logs_through_the_handler_once_a_worker_imports_it() -> None:
    """A worker imports transformers only for a checkpoint that needs it (a RoPE variant, a
    `.bin` file, a model to convert); its logger and bars are taken over when it does."""
    script = (
        "import sys\n"
        "from shared.logs import setup_logging\n"
        "from shared.settings import Settings\n"
        "setup_logging(Settings(log_format='json'), loads_models=True)\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers import AutoConfig\n"  # as the worker's lazy imports do
        "from transformers.utils import logging as tl\n"
        "tl.get_logger('transformers.test').warning('said by transformers')\n"
        "assert not tl.is_progress_bar_enabled()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=child_env(None, "rs"))
    assert done.returncode == 0, done.stderr
    [record] = _json_lines(done.stderr)
    assert record["logger"] == "transformers.test" and record["msg"] == "said by transformers"


def _logger(settings: Settings) -> tuple[logging.Logger, io.StringIO]:
    """A logger outside the process's tree, writing through the handler `settings` make
    into a buffer (not a terminal)."""
    logger = logging.Logger(f"redserve.test.{uuid.uuid4().hex[:8]}", logging.DEBUG)
    stream = io.StringIO()
    logger.addHandler(make_handler(settings, stream))
    return logger, stream


def test_text_shows_an_events_fields_as_key_value() -> None:
    logger, stream = _logger(Settings(log_format="text"))
    log_event(logger, "request.finished", request_id="abc-1", tenant="team a", ttft_s=0.25,
              outcome="stop", prompt=SECRET)
    [line] = stream.getvalue().splitlines()
    assert TEXT_LINE.match(line), line
    assert line.endswith(f"{logger.name}: request.finished request_id=abc-1 tenant=\"team a\" "
                         "ttft_s=0.25 outcome=stop"), line


def test_json_holds_every_field_and_any_value_without_failing() -> None:
    logger, stream = _logger(Settings(log_format="json"))
    cycle: list[Any] = []
    cycle.append(cycle)
    log_event(logger, "odd.values", request_id="abc-2", huge=2**70, surrogate="a\udc80b",
              thing=object(), cycle=cycle, keys={1: "one"}, msg="not the message",
              prompt=SECRET)
    logger.info("arguments that do not fit %d", "x")
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        logger.exception("failed")
    odd, unfit, failed = _json_lines(stream.getvalue())
    assert odd["msg"] == odd["event"] == "odd.values" and odd["request_id"] == "abc-2"
    assert odd["huge"] == str(2**70) and odd["thing"].startswith("<object object")
    assert odd["keys"] == {"1": "one"} and "prompt" not in odd
    assert "arguments that do not fit" in unfit["msg"]
    assert failed["level"] == "ERROR" and "ZeroDivisionError" in failed["exc"]


def test_request_text_fields_only_when_the_operator_asks() -> None:
    logger, stream = _logger(Settings(log_format="json", log_request_text=True))
    log_event(logger, "request.text", request_id="abc-3", prompt=SECRET, output="reply")
    [record] = _json_lines(stream.getvalue())
    assert record["prompt"] == SECRET and record["output"] == "reply"
