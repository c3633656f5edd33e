"""A snapshot drawn as rich tables (what a person reads) or as one JSON document (what a
program reads); both carry the same figures.

Every name in a snapshot comes from Redis (tenants, models, workers, devices): each goes into
a table as a `Text`, never as a string rich would read as markup, so a tenant called
`team[/b]` is printed as it is rather than failing the view.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import orjson
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ops.inspector.snapshot import LimitView, Snapshot, Unreadable, WorkerView
from ops.inspector.stored import StoredResponses

STATE_STYLE = {"queued": "yellow", "running": "cyan", "streaming": "green",
               "resumable": "magenta", "cancelling": "red"}


def as_json(snapshot: Snapshot) -> str:
    return orjson.dumps(asdict(snapshot)).decode()


def tables(snapshot: Snapshot) -> RenderableType:
    parts: list[RenderableType] = [_summary(snapshot), _requests(snapshot), _models(snapshot),
                                   _workers(snapshot)]
    if snapshot.limits:
        parts.append(_limits(snapshot.limits))
    if any(m.served for m in snapshot.models):
        parts.append(_tenants(snapshot))
    if snapshot.stored_responses.count:
        parts.append(_stored(snapshot.stored_responses))
    if snapshot.unreadable:
        parts.append(_unreadable(snapshot.unreadable))
    return Group(*parts)


def _summary(s: Snapshot) -> Text:
    at = time.strftime("%H:%M:%S", time.localtime(s.taken_at))
    scope = ("model ", (s.model_filter, "bold")) if s.model_filter else ("all models",)
    omitted = f" ({s.omitted} more not listed: --limit)" if s.omitted else ""
    unreadable = (f", {len(s.unreadable)} unreadable key(s) (listed last)" if s.unreadable
                  else "")
    return Text.assemble(
        ("redserve", "bold"), " prefix ", (s.key_prefix, "bold"), ", ", *scope, f", at {at}: ",
        (str(s.in_flight), "bold"), f" request(s) in flight{omitted}, {s.finished} finished "
        f"(keys not expired yet){unreadable}")


def _requests(s: Snapshot) -> Table:
    table = Table(title="requests in flight (oldest first)", title_justify="left")
    for name in ("id", "model", "tenant", "state", "age", "prompt", "generated", "worker",
                 "replica"):
        table.add_column(name, justify="right" if name in ("age", "prompt", "generated")
                         else "left", no_wrap=True)
    for r in s.requests:
        table.add_row(Text(r.id), Text(r.model), Text(r.tenant),
                      Text(r.state, style=STATE_STYLE.get(r.state, "")), f"{r.age_s:.1f}s",
                      str(r.prompt_tokens), _count(r.generated_tokens), Text(r.worker or "-"),
                      Text(r.replica))
    return table


def _models(s: Snapshot) -> Table:
    table = Table(title="models", title_justify="left")
    for name in ("model", "queued", "stream", "lag", "pending", "live workers"):
        table.add_column(name, justify="left" if name in ("model", "live workers") else "right",
                         no_wrap=True)
    for m in s.models:
        table.add_row(Text(m.name), str(m.queued), str(m.stream_length), _count(m.lag),
                      str(m.pending),
                      Text(", ".join(m.live_workers)) if m.live_workers
                      else Text("none", style="red"))
    return table


def _tenants(s: Snapshot) -> Table:
    """The fair share's service counters: tokens served per tenant over its weight."""
    table = Table(title="tenants (tokens served / weight)", title_justify="left")
    table.add_column("model", no_wrap=True)
    table.add_column("tenant", no_wrap=True)
    table.add_column("served", justify="right", no_wrap=True)
    for m in s.models:
        for tenant, served in m.served.items():
            table.add_row(Text(m.name), Text(tenant), f"{served:,.0f}")
    return table


def _stored(stored: StoredResponses) -> Table:
    """Stored `/v1/responses` replies per tenant, and the memory they hold."""
    how = ("measured" if stored.measured == stored.count
           else f"estimated from {stored.measured} measured")
    table = Table(title=f"stored responses: {stored.count}, {_bytes(stored.memory_bytes)} "
                  f"({how})", title_justify="left")
    table.add_column("tenant", no_wrap=True)
    table.add_column("responses", justify="right", no_wrap=True)
    table.add_column("memory", justify="right", no_wrap=True)
    for t in stored.tenants:
        table.add_row(Text(t.tenant), str(t.count), _bytes(t.memory_bytes))
    return table


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _workers(s: Snapshot) -> Table:
    table = Table(title="workers", title_justify="left")
    text = ("worker", "model", "device", "dtype", "kernels", "threads", "adapters")
    for name in ("worker", "model", "beat", "running", "waiting", "KV used", "KV free",
                 "prefix pages", "tokens/s", "drafts accepted", "tokens/step", *text[2:]):
        table.add_column(name, justify="left" if name in text else "right", no_wrap=True)
    for w in s.workers:
        beat = "?" if w.heartbeat_age_s is None else f"{w.heartbeat_age_s:.1f}s ago"
        table.add_row(
            Text(w.name + (" (draining)" if w.draining else "")), Text(w.model), beat,
            f"{w.running}/{w.capacity}", str(w.waiting),
            f"{w.kv_pages_used}/{w.kv_pages_total}", str(w.kv_pages_free), str(w.prefix_pages),
            "?" if w.tokens_per_s is None else f"{w.tokens_per_s:.1f}",
            "-" if w.draft_acceptance is None else f"{w.draft_acceptance:.0%}",
            "-" if w.tokens_per_step is None else f"{w.tokens_per_step:.2f}", Text(w.device),
            Text(w.dtype), Text((w.kernels or "?") + (", batch-invariant"
                                                       if w.batch_invariant else "")),
            _threads(w), Text(", ".join(w.loras) or "-"))
    return table


def _threads(w: WorkerView) -> str:
    """The thread policy (worker/engine/threads.py): `up to 2, measured (now 1)`, or `up to 2,
    1 in decode steps` where the operator pinned the count of steps under 256 tokens."""
    if not w.threads:
        return "-" if w.kernels else "?"  # no policy (a GPU worker), or a worker too old to say
    if w.decode_threads:
        return f"up to {w.threads}, {w.decode_threads} in decode steps"
    return f"up to {w.threads}, measured" + (f" (now {w.threads_last})" if w.threads_last
                                             else "")


def _limits(limits: tuple[LimitView, ...]) -> Table:
    table = Table(title="rate limits used this minute (remaining/limit, per tenant per model)",
                  title_justify="left")
    for name in ("model", "tenant", "requests", "tokens"):
        table.add_column(name, justify="left" if name in ("model", "tenant") else "right",
                         no_wrap=True)
    for v in limits:
        table.add_row(Text(v.model), Text(v.tenant),
                      _left(v.requests_remaining, v.requests_limit),
                      _left(v.tokens_remaining, v.tokens_limit))
    return table


def _left(remaining: int | None, limit: int) -> str:
    return "-" if remaining is None else f"{remaining}/{limit}"


def _unreadable(keys: tuple[Unreadable, ...]) -> Table:
    table = Table(title="unreadable keys (not what redserve writes there)", title_justify="left",
                  title_style="red")
    table.add_column("key", no_wrap=True)
    table.add_column("problem")
    for u in keys:
        table.add_row(Text(u.key), Text(u.problem))
    return table


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)
