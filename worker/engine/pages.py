"""Page allocation with prefix reuse: a free list, reference counts and a hash-chained index.

A full page is identified by its tokens and, through the chain, every token before it: its key
is a keyed BLAKE2b digest of (the previous page's key, its tokens), under a secret drawn when the
manager is made. A client cannot find two prompts whose chains collide (not even by searching
offline: it does not know the secret), so no request can reuse, or poison, KV computed for
another's different prefix; the page's own tokens are still compared on a match. Each chain
starts from its tenant's root key, so tenants never share pages: otherwise a tenant could learn
whether another's prompt starts with a guess from how many of its tokens came from the cache.
A request under a LoRA adapter starts from a root of its tenant and adapter: the same tokens
have other K and V under another adapter, so adapters never share pages either.
Once computed, a full page is published under its key, so a later request whose prompt starts
with the same tokens takes the page instead of recomputing it. Published pages nobody
references stay cached until the free list runs dry; then the least recently released one is
evicted and reused, leaves of a chain before its head.

Each key also carries the page's public digest (shared/page_digest.py: an unkeyed chain over
the tenant and the tokens, 8 bytes) after its secret part, so the set of cached pages can be
announced (`summary`) for prefix-aware placement without revealing the secret chain: API
replicas compute the same public chain from a prompt. The summary's version changes whenever a
page is published or evicted, so the heartbeat rewrites it only then. Computing the public
digest costs one more small hash per full page, never anything per token.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from shared.messages import PrefixSummary
from shared.page_digest import PAGE_DIGEST_SIZE, next_digest, root_name, tenant_root

_SECRET_SIZE = 16


class PageManager:
    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._secret = secrets.token_bytes(32)
        self._page_by_key: dict[bytes, int] = {}
        self._key_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # page -> (key, its tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        # Bumped on every publish and eviction; it starts from the clock so that a worker
        # restarted under the same name never repeats a version a replica has already read.
        self.version = time.time_ns()

    @property
    def available(self) -> int:
        """Pages that an allocation can take now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def cached(self) -> int:
        """Pages held only by the prefix cache."""
        return len(self._evictable)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def published(self) -> int:
        """Full pages the prefix cache can serve (referenced or not)."""
        return len(self._key_of)

    def root(self, tenant: str, lora: str = "") -> bytes:
        """Where the chains of `tenant`'s requests under LoRA adapter `lora` ("" for the base)
        start (secret part, then public)."""
        secret = hashlib.blake2b(root_name(tenant, lora), digest_size=_SECRET_SIZE,
                                 key=self._secret, person=b"lora" if lora else b"tenant")
        return secret.digest() + tenant_root(tenant, lora)

    def chain(self, key: bytes, chunk: tuple[int, ...]) -> bytes:
        """The key of a page holding `chunk` after the page whose key is `key`."""
        digest = hashlib.blake2b(key[:_SECRET_SIZE], digest_size=_SECRET_SIZE, key=self._secret)
        digest.update(array("q", chunk).tobytes())
        return digest.digest() + next_digest(key[_SECRET_SIZE:], chunk)

    def summary(self) -> PrefixSummary:
        """The public digests of every published page. Safe to call while a step runs on
        another thread: the keys are copied in one C call."""
        version = self.version
        return PrefixSummary(self.page_size, version, frozenset(
            key[-PAGE_DIGEST_SIZE:] for key in tuple(self._page_by_key)))

    def match(self, tokens: Sequence[int], root: bytes) -> tuple[list[int], list[bytes]]:
        """The cached pages that start `tokens`, referenced for the caller, and their keys.

        At least one token is always left over: the model must run on the last prompt token
        to produce the first output token's logits.
        """
        pages: list[int] = []
        keys: list[bytes] = []
        if not self.prefix_caching:
            return pages, keys
        key = root
        for i in range((len(tokens) - 1) // self.page_size):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            key = self.chain(key, chunk)
            page = self._page_by_key.get(key)
            if page is None or self._key_of[page][1] != chunk:
                break
            pages.append(page)
            keys.append(key)
        for page in pages:
            self._take(page)
        return pages, keys

    def allocate(self, n: int) -> list[int] | None:
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                key, _tokens = self._key_of.pop(page)
                del self._page_by_key[key]
                self.version += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Give back a request's pages. Its leaf goes first into the eviction order and its
        head last: a chain is evicted from its leaf, so what stays cached is always a prefix
        a later prompt can still reach (a chain without its head is unreachable)."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def publish(self, tokens: Sequence[int], pages: Sequence[int], keys: list[bytes],
                num_computed: int, root: bytes) -> None:
        """Publish the request's newly completed full pages; `keys` (the request's chain so
        far) is extended in place."""
        if not self.prefix_caching:
            return
        key = keys[-1] if keys else root
        for i in range(len(keys), num_computed // self.page_size):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            key = self.chain(key, chunk)
            keys.append(key)
            page = pages[i]
            if key not in self._page_by_key and page not in self._key_of:
                self._page_by_key[key] = page
                self._key_of[page] = (key, chunk)
                self.version += 1

    def _take(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1

    def check(self) -> None:
        """Every page is exactly one of: referenced, cached and unreferenced, or free."""
        referenced = sum(1 for r in self._refs if r > 0)
        assert min(self._refs) >= 0, "negative page reference count"
        assert referenced + len(self._evictable) + len(self._free) == self.num_pages
        assert not set(self._free) & set(self._evictable)
