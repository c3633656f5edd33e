"""A worker's prefix summary (`Keys.prefixes`): the public digests of every full page its
prefix cache holds (`shared.page_digest`), read by the API replicas' placement.

Binary, not JSON: it is read whole, once per change, and may hold a digest for every page of
the KV pool (8 bytes each: 64 KiB for 8,192 pages). Layout: magic `RSP1`, then little-endian
uint32 page size, uint64 version, then the digests, 8 bytes each, sorted. The version is the
one the worker's heartbeat carries (`Heartbeat.prefix_version`), so a replica re-reads the
summary only when the heartbeat says it changed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shared.page_digest import PAGE_DIGEST_SIZE

_MAGIC = b"RSP1"
_HEAD = struct.Struct("<IQ")


@dataclass(frozen=True)
class PrefixSummary:
    page_size: int
    version: int
    digests: frozenset[bytes]

    def encode(self) -> bytes:
        return (_MAGIC + _HEAD.pack(self.page_size, self.version)
                + b"".join(sorted(self.digests)))

    @classmethod
    def decode(cls, raw: bytes) -> PrefixSummary:
        """ValueError saying what is wrong with a body that is not a summary."""
        body = raw[len(_MAGIC) + _HEAD.size:]
        if not raw.startswith(_MAGIC) or len(body) % PAGE_DIGEST_SIZE:
            raise ValueError(f"not a prefix summary: {raw[:16]!r} ({len(raw)} bytes)")
        page_size, version = _HEAD.unpack_from(raw, len(_MAGIC))
        return cls(page_size, version, frozenset(
            body[i:i + PAGE_DIGEST_SIZE] for i in range(0, len(body), PAGE_DIGEST_SIZE)))
