"""oneDNN's primitive caches, capped once for every worker and benchmark: `cap_caches`.

oneDNN keeps every primitive it builds (1,024 by default, and torch's ideep a cache of its own
in front), one per linear shape per token count, each holding memory in proportion to its
weight: 472 token counts through the default model's four decoder shapes grew a worker's RSS by
1,818 MiB, and a worker meets a new token count with nearly every new mix of prefill and decode.
A step runs five shapes at one token count, so 16 entries serve steady decode with no more
misses (19 in both a prefill-and-decode run and the default) and the growth stops (62 MiB over
the same 472 counts). Both caches need the cap: with oneDNN's at 8,192 and ideep's at 16 (what
`redserve worker` set until the cap was decided here alone), 300 token counts through those
shapes grew RSS by 857 MiB against 17 with both at 16, and 662 with both at their defaults.

oneDNN and ideep read their capacity from the environment once, when the first primitive is
built, so `cap_caches` runs at the start of `worker/engine/build.py`'s `build_engine` (which
`redserve worker`, `redserve up`'s workers and the engine benchmarks go through) before any
weight is loaded; a benchmark that builds a `ModelRunner` itself calls it first. A capacity
already in the environment is kept: an operator's override wins.
"""

from __future__ import annotations

import os

CACHE_ENTRIES = 16
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN, ideep


def cap_caches() -> dict[str, str]:
    """Set both capacities unless the environment has them; returns those in effect."""
    return {name: os.environ.setdefault(name, str(CACHE_ENTRIES)) for name in CAPACITY_VARIABLES}
