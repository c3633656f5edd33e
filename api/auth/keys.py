"""API keys and the tenants they belong to.

Keys come from `REDSERVE_API_KEYS` (comma-separated) and/or `REDSERVE_API_KEYS_FILE` (one a
line, `#` comments). An entry is `tenant:key`, or a bare key, whose tenant is then named after
a digest of the key. Several keys may share a tenant (rotation, several services of one team):
ownership of a request (cancel, resume) belongs to the tenant, so any of its keys may act on
it, and no other tenant can even see that it exists.

Only digests of the keys are kept, and a presented key is looked up by its digest, so the time
a lookup takes says nothing about how much of a key was right.

Serving without keys is allowed only when asked for (`REDSERVE_NO_AUTH=true`); then every
caller is the one tenant `anonymous`. Configured keys always win over that flag.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

ANONYMOUS = "anonymous"
_TENANT = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class AuthConfigError(ValueError):
    """The configured keys are unusable; the replica must not start."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class APIKeys:
    by_digest: dict[bytes, str]  # sha256(key) -> tenant; empty: authentication is off

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self.by_digest.values())

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header; None if it is not valid."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self.by_digest.get(_digest(key.strip()))

    @classmethod
    def parse(cls, entries: list[str]) -> APIKeys:
        by_digest: dict[bytes, str] = {}
        for raw in entries:
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            tenant, sep, key = entry.partition(":")
            if not sep:
                tenant, key = f"key-{_digest(entry).hex()[:12]}", entry
            if not _TENANT.match(tenant):
                raise AuthConfigError(f"API key entry for tenant {tenant[:64]!r}: a tenant is "
                                      "1-64 of A-Z a-z 0-9 _ . @ -")
            if len(key) < 8 or any(c.isspace() for c in key):
                raise AuthConfigError(f"API key of tenant {tenant!r}: a key is at least 8 "
                                      "characters, without spaces")
            by_digest[_digest(key)] = tenant
        return cls(by_digest)

    @classmethod
    def load(cls, keys: str, keys_file: Path | None) -> APIKeys:
        entries = keys.split(",")
        if keys_file is not None:
            try:
                entries += keys_file.read_text().splitlines()
            except OSError as e:
                raise AuthConfigError(f"cannot read the API keys file {keys_file}: "
                                      f"{e.strerror}") from None
        return cls.parse(entries)
