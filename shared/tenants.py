"""What each tenant is allowed: its rate limits and its weight in the fair share of a model.

One policy file (`REDSERVE_TENANTS_FILE`, TOML) names the tenants that differ from the default;
every other tenant gets the default from settings. The API replicas enforce the rate limits
(`api/queue/limits/`) and carry the weight into each request's queue entry, so workers need no copy
of this file: a tenant's policy changes with a rolling restart of the replicas alone.

    [tenants.acme]                # a tenant of the API keys (see api/auth/keys.py)
    requests_per_minute = 600     # 0: no limit
    tokens_per_minute = 200000    # prompt + max completion tokens, reserved at admission
    weight = 2.0                  # its share of a busy model beside the others (default 1)
    adapters = ["acme-support"]   # the LoRA adapters it may name (absent: all of them)
    admin = true                  # may load and unload adapters at run time (default false)

The limits are per tenant per model (each model's buckets live in that model's Redis slot), as
OpenAI's are per model. `tenant_policies` is the one place a process loads them.

A tenant limited to named adapters sees any other adapter exactly as a name that does not
exist (404 `model_not_found`, left out of `/v1/models`); the base models stay open to it. Names
in its list that no adapter has (yet) are allowed: adapters come and go at run time.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.settings import ApiSettings


class TenantsConfigError(ValueError):
    """The tenants file is unusable; the replica must not start."""


@dataclass(frozen=True)
class TenantPolicy:
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0  # 0: unlimited
    weight: float = 1.0  # > 0; twice the weight, twice the service under contention
    adapters: frozenset[str] | None = None  # the LoRA adapters it may name; None: all
    admin: bool = False  # may load and unload LoRA adapters at run time

    def may_use(self, adapter: str) -> bool:
        """Whether this tenant may name the LoRA adapter `adapter`."""
        return self.adapters is None or adapter in self.adapters


@dataclass(frozen=True)
class TenantPolicies:
    default: TenantPolicy = TenantPolicy()
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)

    def of(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant, self.default)

    @classmethod
    def load(cls, default: TenantPolicy, path: Path | None) -> TenantPolicies:
        if path is None:
            return cls(default)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise TenantsConfigError(f"cannot read the tenants file {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise TenantsConfigError(f"the tenants file {path} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as e:
            raise TenantsConfigError(f"the tenants file {path} is not valid TOML: {e}") from None
        unknown = set(data) - {"tenants"}
        if unknown:
            raise TenantsConfigError(f"the tenants file {path} has unknown tables or keys "
                                     f"{sorted(unknown)}: only [tenants.<name>] tables")
        tenants = data.get("tenants", {})
        if not isinstance(tenants, dict):
            raise TenantsConfigError(f"the tenants file {path}: `tenants` must be a table")
        return cls(default, {name: _policy(name, entry, default)
                             for name, entry in tenants.items()})


def tenant_policies(settings: ApiSettings) -> TenantPolicies:
    """Every tenant's policy: the tenants file over the defaults of the settings.
    TenantsConfigError (the process must not start) for a file that is unusable."""
    return TenantPolicies.load(
        TenantPolicy(settings.requests_per_minute, settings.tokens_per_minute),
        settings.tenants_file)


def _policy(name: str, entry: Any, default: TenantPolicy) -> TenantPolicy:
    where = f"tenant {name!r} of the tenants file"
    if not isinstance(entry, dict):
        raise TenantsConfigError(f"{where}: must be a table")
    unknown = set(entry) - {"requests_per_minute", "tokens_per_minute", "weight", "adapters",
                            "admin"}
    if unknown:
        raise TenantsConfigError(f"{where}: unknown keys {sorted(unknown)}")
    values = {"requests_per_minute": default.requests_per_minute,
              "tokens_per_minute": default.tokens_per_minute, "weight": default.weight, **entry}
    for key in ("requests_per_minute", "tokens_per_minute"):
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TenantsConfigError(f"{where}: {key} must be a whole number >= 0, "
                                     f"not {value!r}")
    weight = values["weight"]
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise TenantsConfigError(f"{where}: weight must be a number > 0, not {weight!r}")
    adapters = entry.get("adapters")
    if adapters is not None and (not isinstance(adapters, list)
                                 or not all(isinstance(a, str) and a for a in adapters)):
        raise TenantsConfigError(f"{where}: adapters must be a list of adapter names, "
                                 f"not {adapters!r}")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise TenantsConfigError(f"{where}: admin must be true or false, not {admin!r}")
    return TenantPolicy(values["requests_per_minute"], values["tokens_per_minute"],
                        float(weight), None if adapters is None else frozenset(adapters), admin)
