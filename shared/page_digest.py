"""The public digest of a cached page: what a worker announces it holds, and what an API
replica computes from a prompt to find the worker holding its longest prefix.

A worker's prefix cache is keyed by a secret chain (worker/engine/pages.py) that nobody outside it
can compute, and that must stay so: it is what stops one request reusing or poisoning another's KV.
Placement needs a chain that both sides compute: an unkeyed BLAKE2b chain over (tenant and
LoRA adapter, each page's tokens), 8 bytes a page. It never decides what KV a request reuses
(the secret chain and the page's own tokens do), so a collision only sends a request to a
worker that does not hold its prefix. Both sides import this one module, so their chains
cannot drift apart.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

PAGE_DIGEST_SIZE = 8


def tenant_root(tenant: str, lora: str = "") -> bytes:
    """Where the chains of `tenant`'s pages start, under LoRA adapter `lora` ("" for the base
    model): neither tenants nor adapters share pages (an adapter's KV is not the base's)."""
    person = b"redserve-lora" if lora else b"redserve-tenant"
    return hashlib.blake2b(root_name(tenant, lora), digest_size=PAGE_DIGEST_SIZE,
                           person=person).digest()


def root_name(tenant: str, lora: str) -> bytes:
    """What a chain's root is hashed from: the tenant's name, or with an adapter the tenant's
    name (length first, so that no two pairs give the same bytes) and the adapter's."""
    name = tenant.encode()
    return len(name).to_bytes(4, "big") + name + lora.encode() if lora else name


def next_digest(previous: bytes, chunk: Sequence[int]) -> bytes:
    """The digest of a page holding `chunk` after the page whose digest is `previous`."""
    ids = array("q", chunk)
    if sys.byteorder == "big":  # one byte order on every machine of a deployment
        ids.byteswap()
    digest = hashlib.blake2b(previous, digest_size=PAGE_DIGEST_SIZE, person=b"redserve-page")
    digest.update(ids.tobytes())
    return digest.digest()


def prompt_digests(tokens: Sequence[int], page_size: int, tenant: str,
                   lora: str = "") -> list[bytes]:
    """The digests of the full pages a worker could take from its cache for this prompt (of
    `tenant`, under adapter `lora`): all but the last token's (the model must run on the last
    prompt token)."""
    digests = []
    digest = tenant_root(tenant, lora)
    for i in range((len(tokens) - 1) // page_size):
        digest = next_digest(digest, tokens[i * page_size : (i + 1) * page_size])
        digests.append(digest)
    return digests
