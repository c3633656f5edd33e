"""Hooks for tests and benchmarks, kept out of the production `Settings`.

Three switches change what a worker computes, and no operator should ever set any, so they
are not settings an operator reads about in `--help` or `shared/settings.py`: they are read
here, from their own environment variables, by the places that act on them.
- `REDSERVE_FAULT_TOKEN_ID`: a step whose batch holds a prompt containing this token id
  raises, as a model failure would (the chaos, lifecycle and leak-audit tests);
- `REDSERVE_SYNTHETIC_STEP_MS`: the model is replaced by a stand-in whose every step takes
  this long (`worker/engine/synthetic.py`), so the serving layer can be measured without a model
  worth its time (`ops/benchmarks/broker.py`, `ops/benchmarks/redis_cost.py`);
- `REDSERVE_FAULT_KERNEL=<check>:<raise|wrong|crash>`: one check of the native kernels' smoke
  test at start (`worker/engine/smoke.py`) fails as a broken library would, raising, computing
  a wrong result or killing its process with SIGILL (tests/test_smoke.py).
"""

from __future__ import annotations

from typing import Literal, cast, get_args

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

FaultMode = Literal["raise", "wrong", "crash"]


class DevHooks(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REDSERVE_", frozen=True, extra="ignore")

    fault_token_id: int | None = None
    synthetic_step_ms: float = Field(default=0.0, ge=0)
    fault_kernel: str | None = None

    @field_validator("fault_kernel")
    @classmethod
    def _check_fault_kernel(cls, value: str | None) -> str | None:
        if value is not None and value.rpartition(":")[2] not in get_args(FaultMode):
            raise ValueError(f"REDSERVE_FAULT_KERNEL is <check>:<{'|'.join(get_args(FaultMode))}>,"
                             f" not {value!r}")
        return value

    def kernel_fault(self) -> tuple[str, FaultMode] | None:
        """(check, how) of `REDSERVE_FAULT_KERNEL`, or None."""
        if self.fault_kernel is None:
            return None
        check, _, how = self.fault_kernel.rpartition(":")
        return check, cast(FaultMode, how)
