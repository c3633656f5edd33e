"""Where Redis is, when it is a primary that Sentinel fails over: a `redis+sentinel://` URL.

redserve is given one setting, `REDIS_URL`, and every process (replica, worker, `inspect`,
`up`'s children) reads it. A primary that moves cannot be named by one host, so the URL may
name the Sentinels instead, and the primary by its Sentinel name:

    redis+sentinel://[[user]:password@]host:port[,host:port...]/<master name>[/<db>]
        [?sentinel_password=...&sentinel_username=...]

(`rediss+sentinel://` for TLS to both.) The user and password are the data nodes'; Sentinels
often have none, or their own (`sentinel_password`). redis-py has no URL form for Sentinel, so
this module parses it, into the frozen `SentinelAddress` that `shared/redis_conn.py` connects
with; the settings parse it too, so a malformed URL stops a process at start, not at its first
command. `public` is a URL fit for a log line or an error message (no password).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelAddress:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The Sentinels, the primary's name, the db and the credentials a sentinel URL names
    (ValueError, saying what is wrong, for anything else)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (redis+sentinel://...): {public(url)}")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    sentinels = tuple(_host_port(h) for h in hosts.split(",") if h)
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one Sentinel: "
                         "redis+sentinel://host:port[,host:port...]/<master name>")
    master, _, db = path.partition("/")
    if not master:
        raise ValueError("a Sentinel URL names the primary after the hosts: "
                         "redis+sentinel://host:port/<master name>[/<db>]")
    if db and not db.isdigit():
        raise ValueError(f"the database in a Sentinel URL is a number, not {db!r}")
    options = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(options) - {"sentinel_password", "sentinel_username"}
    if unknown:
        raise ValueError(f"unknown Sentinel URL option(s): {', '.join(sorted(unknown))}")
    return SentinelAddress(
        sentinels=sentinels, master=unquote(master), db=int(db or 0),
        username=unquote(username) or None, password=unquote(password) or None,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
        tls=SENTINEL_SCHEMES[scheme.lower()])


def _host_port(text: str) -> tuple[str, int]:
    """`host:port`, `host` (the Sentinel port) or `[v6 address]:port`."""
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", text)
    if match is None:
        raise ValueError(f"not a host:port in a Sentinel URL: {text!r}")
    v6, v6_port, host, port = match.groups()
    return v6 or host, int(v6_port or port or DEFAULT_SENTINEL_PORT)


def public(url: str) -> str:
    """`url` with its passwords masked."""
    if is_sentinel_url(url):
        scheme, _, rest = url.partition("://")
        netloc, slash, tail = rest.partition("/")
        credentials, at, hosts = netloc.rpartition("@")
        if at and ":" in credentials:
            credentials = credentials.split(":", 1)[0] + ":***"
        path, question, query = tail.partition("?")
        masked = "&".join(
            f"{p.split('=', 1)[0]}=***" if p.startswith("sentinel_password=") else p
            for p in query.split("&")) if query else ""
        return f"{scheme}://{credentials}{at}{hosts}{slash}{path}{question}{masked}"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    return urlunsplit(parts._replace(netloc=netloc + (f":{parts.port}" if parts.port else "")))
