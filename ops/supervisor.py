"""Keeping `redserve up`'s children running.

`up` is the whole system on one machine, so a worker that crashes (out of memory, a CUDA
fault, a kill by the OOM killer) or an API replica that dies must come back by itself, as a
pod would under Kubernetes, rather than take everything down. A child that exits while `up`
is not stopping is started again with the same command line (the same worker `--name`, so the
worker takes back the requests still pending under it; the same API port), after a delay that
doubles on each failure up to a cap, so a child that cannot start does not spin. The delay
starts over once a child has stayed up a while. Stopping is `up`'s: SIGTERM to every child
(they drain), a kill after a grace, and no restarts from then on. A rolling restart (SIGUSR2 to
`up`) stops and starts each child in turn, the next one only once the last serves again
(`ChildSpec.ready`), so the system never stops serving: a replica's streams are resumed on
another, a worker's requests taken back by the worker it hands them to.

Every exit it notices is logged with the child's name, how it ended and when it comes back,
as prose for a person and as fields (`child.exited`, `child.failing`) for a log collector.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
log = logging.getLogger("redserve.up")


@dataclass(frozen=True)
class Backoff:
    """When to restart a child that exited, given how it has been failing."""

    initial_s: float = 0.5
    cap_s: float = 10.0
    # A child that ran this long was healthy: its next failure starts from `initial_s` again.
    # One that exits sooner `failing_after` times in a row "keeps failing" (it is still
    # restarted, at the capped pace: what it lacks, a GPU or a port, may come back). Starting
    # a worker takes seconds (torch, the checkpoint), so "sooner" cannot be much shorter.
    reset_after_s: float = 30.0
    failing_after: int = 5

    def after_exit(self, failures: int, ran_s: float) -> tuple[int, float]:
        """(failures in a row, delay before the restart) for a child that has just exited
        after running `ran_s`, having failed `failures` times in a row before."""
        failures = 1 if ran_s >= self.reset_after_s else failures + 1
        return failures, min(self.cap_s, self.initial_s * 2.0 ** min(failures - 1, 64))

    def keeps_failing(self, failures: int) -> bool:
        return failures >= self.failing_after


def _always() -> bool:
    return True


@dataclass(frozen=True)
class ChildSpec:
    name: str  # what the log calls it: "worker host-up42-0-0 (tiny)", "API replica :8000"
    argv: tuple[str, ...]
    ready: Callable[[], bool] = _always  # whether it serves (after a start)


class Child:
    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.failures = 0  # in a row, each before `Backoff.reset_after_s`
        self.restart_at: float | None = None  # when an exited child is started again
        self.restarts = 0


def _die_with_parent() -> None:
    """In the child, before it runs: on Linux, be sent SIGTERM should `up` itself die without
    stopping its children (SIGKILL), so none is left running on its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Starts the children, restarts the ones that exit (call `poll` often), stops them all.
    Single-threaded: every method runs on the caller's thread."""

    def __init__(self, specs: Sequence[ChildSpec], env: Mapping[str, str],
                 backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.children = [Child(s) for s in specs]
        self.env = dict(env)
        self.backoff = backoff
        self.clock = clock
        self.stopping = False

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        # Its own process group: Ctrl-C in the terminal reaches `up` alone, which then asks
        # each child once (SIGTERM) to drain; a second signal would stop it at once.
        child.proc = subprocess.Popen(list(child.spec.argv), env=self.env, process_group=0,
                                      preexec_fn=_die_with_parent)
        child.started_at = self.clock()
        child.restart_at = None

    def poll(self) -> None:
        """Notice exited children and restart those whose delay has passed."""
        for child in self.children:
            if self.stopping:
                return
            now = self.clock()
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    self._spawn(child)
                continue
            assert child.proc is not None
            code = child.proc.poll()
            if code is None:
                continue
            ran = now - child.started_at
            child.failures, delay = self.backoff.after_exit(child.failures, ran)
            child.restart_at = now + delay
            failing = self.backoff.keeps_failing(child.failures)
            fields = {"event": "child.failing" if failing else "child.exited",
                      "child": child.spec.name, "exit_code": code, "ran_s": round(ran, 1),
                      "failures": child.failures, "restart_in_s": delay}
            if failing:
                log.error("%s keeps failing: %s after %.1fs, %d times in a row within %gs of "
                          "starting; restarting in %gs (its own log above says why)",
                          child.spec.name, describe_exit(code), ran, child.failures,
                          self.backoff.reset_after_s, delay, extra={"fields": fields})
            else:
                log.warning("%s %s after %.1fs; restarting in %gs", child.spec.name,
                            describe_exit(code), ran, delay, extra={"fields": fields})

    def roll(self, grace: float, stopping: Callable[[], bool]) -> None:
        """A rolling restart: each child in turn is stopped (SIGTERM: it drains; killed past
        `grace`) and started again at once, and the next waits until it is ready; exited
        children go on being restarted meanwhile. Ends early once `stopping()`."""
        log.info("rolling restart: %d children, one at a time",
                 len(self.children), extra={"fields": {"event": "up.rolling"}})
        for child in self.children:
            if stopping() or self.stopping:
                return
            proc = child.proc
            if proc is not None and proc.poll() is None:
                log.info("rolling restart: stopping %s", child.spec.name)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            child.restarts += 1
            child.failures = 0
            self._spawn(child)
            while not child.spec.ready() and not stopping():
                self.poll()
                time.sleep(0.2)
        log.info("rolling restart done", extra={"fields": {"event": "up.rolled"}})

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every running child (they drain), kill those still running after `grace`;
        nothing is restarted from here on."""
        self.stopping = True
        running = [c.proc for c in self.children if c.proc is not None]
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
