"""The tenants file: what it sets, what every other tenant gets, and a clear refusal of a file
the replicas must not start with."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import ApiSettings
from shared.tenants import TenantPolicies, TenantPolicy, TenantsConfigError, tenant_policies

DEFAULT = TenantPolicy(requests_per_minute=100, tokens_per_minute=5000)


def load(tmp_path: Path, text: str | bytes) -> TenantPolicies:
    path = tmp_path / "tenants.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return TenantPolicies.load(DEFAULT, path)


def test_named_tenants_override_the_default_field_by_field(tmp_path: Path) -> None:
    policies = load(tmp_path, "[tenants.acme]\nrequests_per_minute = 600\nweight = 2\n\n"
                              "[tenants.free]\nrequests_per_minute = 0\ntokens_per_minute = 0\n")
    assert policies.of("acme") == TenantPolicy(600, 5000, 2.0)
    assert policies.of("free") == TenantPolicy(0, 0, 1.0)
    assert policies.of("anyone-else") == DEFAULT


def test_adapters_limit_a_tenant_and_admin_names_who_loads_them(tmp_path: Path) -> None:
    policies = load(tmp_path, '[tenants.acme]\nadapters = ["sql", "chat"]\n\n'
                              '[tenants.ops]\nadmin = true\n\n[tenants.none]\nadapters = []\n')
    acme, ops = policies.of("acme"), policies.of("ops")
    assert (acme.may_use("sql"), acme.may_use("other"), acme.admin) == (True, False, False)
    assert (ops.may_use("anything"), ops.admin) == (True, True)
    assert not policies.of("none").may_use("sql")
    assert policies.of("anyone-else").may_use("sql") and not policies.of("anyone-else").admin


def test_no_file_is_the_settings_default() -> None:
    policies = tenant_policies(ApiSettings(requests_per_minute=7, tokens_per_minute=9))
    assert policies.of("x") == TenantPolicy(7, 9) and not policies.tenants


@pytest.mark.parametrize(("text", "says"), [
    ("[tenants.acme]\nrequests_per_minute = -1\n",
     "tenant 'acme' of the tenants file: requests_per_minute must be a whole number >= 0"),
    ("[tenants.acme]\ntokens_per_minute = 1.5\n", "tokens_per_minute must be a whole number"),
    ("[tenants.acme]\nrequests_per_minute = true\n", "requests_per_minute must be a whole"),
    ("[tenants.acme]\nweight = 0\n", "weight must be a number > 0"),
    ("[tenants.acme]\nadapters = \"sql\"\n", "adapters must be a list of adapter names"),
    ("[tenants.acme]\nadapters = [1]\n", "adapters must be a list of adapter names"),
    ("[tenants.acme]\nadmin = 1\n", "admin must be true or false"),
    ("[tenants.acme]\nrpm = 5\n", "tenant 'acme' of the tenants file: unknown keys ['rpm']"),
    ("[tenant.acme]\nrequests_per_minute = 5\n", "unknown tables or keys ['tenant']"),
    ("tenants = 3\n", "`tenants` must be a table"),
    ("[tenants]\nacme = 5\n", "tenant 'acme' of the tenants file: must be a table"),
    ("[tenants.acme\n", "is not valid TOML"),
    (b"\xff\xfe[tenants]", "is not UTF-8 text"),
])
def test_a_bad_file_is_refused_naming_the_problem(tmp_path: Path, text: str | bytes,
                                                  says: str) -> None:
    with pytest.raises(TenantsConfigError) as caught:
        load(tmp_path, text)
    assert says in str(caught.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TenantsConfigError, match=r"cannot read the tenants file .*: No such"):
        TenantPolicies.load(DEFAULT, tmp_path / "absent.toml")
