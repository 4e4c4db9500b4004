"""`sluice tenants create --allow` and `sluice tenants models`: a tenant's allowed models."""

from __future__ import annotations

import json

from tests.integration.billing.test_cli_billing import cli_env, make_app, run

__all__ = ["cli_env"]  # the fixture


def test_allowed_models_from_the_cli(cli_env: str) -> None:
    app = make_app()
    if cli_env.startswith("postgresql"):
        run(app, "migrate")
    created = json.loads(run(app, "tenants", "create", "acme", "--allow", "m1", "--json"))
    assert created["name"] == "acme"
    listed = json.loads(run(app, "tenants", "list", "--json"))
    assert listed[0]["allowed_models"] == ["m1"]
    assert "models=m1" in run(app, "tenants", "list")
    out = json.loads(
        run(app, "tenants", "models", "acme", "--allow", "a", "--allow", "b", "--json")
    )
    assert out["allowed_models"] == ["a", "b"]
    assert "models=all" in run(app, "tenants", "models", "acme", "--all")
    assert "give --allow" in run(app, "tenants", "models", "acme", code=2)
    assert "give --allow" in run(app, "tenants", "models", "acme", "--all", "--allow", "x", code=2)
    assert "no tenant" in run(app, "tenants", "models", "nobody", "--all", code=2)
    assert "model name" in run(app, "tenants", "models", "acme", "--allow", " ", code=2)
