"""Hooks for tests and benchmarks, kept out of the production `Settings`.

Two switches change what a worker computes, and no operator should ever set either, so they
are not settings an operator reads about in `--help` or `shared/settings.py`: they are read
here, from their own environment variables, by the two places that act on them.
- `REDSERVE_FAULT_TOKEN_ID`: a step whose batch holds a prompt containing this token id
  raises, as a model failure would (the chaos, lifecycle and leak-audit tests);
- `REDSERVE_SYNTHETIC_STEP_MS`: the model is replaced by a stand-in whose every step takes
  this long (`worker/engine/synthetic.py`), so the serving layer can be measured without a model
  worth its time (`ops/benchmarks/broker.py`, `ops/benchmarks/redis_cost.py`).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DevHooks(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REDSERVE_", frozen=True, extra="ignore")

    fault_token_id: int | None = None
    synthetic_step_ms: float = Field(default=0.0, ge=0)
