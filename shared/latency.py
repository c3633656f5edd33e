"""Histogram buckets and rounding shared by the replica's and the worker's timings.

Both sides measure the same request from the same instant (its `created`); with the same
buckets their quantiles compare panel by panel, replica against worker.
"""

from __future__ import annotations

# Seconds: from a fast first token to the longest request timeout.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
# Seconds: gaps between tokens and model steps.
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                     0.5, 1.0, 2.0, 5.0)


def round_s(seconds: float | None) -> float | None:
    """A duration as a log event carries it: to 0.1 ms."""
    return None if seconds is None else round(seconds, 4)
