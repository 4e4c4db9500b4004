"""`sluice migrate|tenants|keys|prices|billing report` on embedded SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sluice.cli_billing import register
from sluice.storage.db import Database, make_engine
from sluice.storage.keys import KeyAuthenticator
from sluice.storage.ledger import UsageLedger
from tests.integration.billing.usage_data import make_usages


def make_app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True)

    @app.callback()
    def _root() -> None:
        """test root"""

    register(app)
    return app


@pytest.fixture(params=["sqlite", "postgresql"])
def cli_env(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The database URL the CLI will use; embedded SQLite when no URL is set."""
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICE_DATABASE_URL", raising=False)
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sluice.db'}"
    from tests.integration.storage.stores import pg_schema

    request.getfixturevalue("pg_database")  # skips/fails when PostgreSQL is missing
    schema = pg_schema("sluice_cli")
    url = schema.__enter__()
    request.addfinalizer(lambda: schema.__exit__(None, None, None))
    monkeypatch.setenv("SLUICE_DATABASE_URL", url)
    return url


def run(app: typer.Typer, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, (args, result.output, result.exception)
    return result.output


def test_the_whole_flow(cli_env: str, tmp_path: Path) -> None:
    app = make_app()
    if cli_env.startswith("postgresql"):
        out = run(app, "tenants", "list", code=1)
        assert "sluice migrate" in out
    run(app, "migrate")
    created = json.loads(run(app, "tenants", "create", "acme", "--rpm", "60", "--tpm", "5000",
                             "--monthly-budget", "25.50", "--json"))  # fmt: skip
    assert set(created) >= {"tenant_id", "name", "api_key"}
    assert created["api_key"].startswith("sk-sluice-")
    tenants = json.loads(run(app, "tenants", "list", "--json"))
    assert tenants[0]["monthly_budget_usd"] == "25.5" and tenants[0]["rpm"] == 60
    second = json.loads(run(app, "keys", "create", "--tenant", "acme", "--json"))
    keys = json.loads(run(app, "keys", "list", "--json"))
    assert len(keys) == 2 and all(second["api_key"] not in json.dumps(k) for k in keys)
    run(app, "keys", "revoke", second["key_id"])
    db = Database(make_engine(cli_env))
    auth = KeyAuthenticator(db)
    assert auth.authenticate(created["api_key"]).tenant_id == created["tenant_id"]
    run(app, "prices", "set", "llama-small", "--input", "0.15", "--cached-input", "0.075",
        "--output", "0.6", "--batch-discount", "0.5")  # fmt: skip
    assert json.loads(run(app, "prices", "list", "--json"))[0]["output_usd"] == "0.6"
    usages = make_usages(20, tenants=(created["tenant_id"], "ten_other"))
    UsageLedger(db).record(usages)
    db.close()
    report = json.loads(run(app, "billing", "report", "--tenant", "acme", "--format", "json"))
    mine = [u for u in usages if u.tenant_id == created["tenant_id"]]
    assert report["totals"]["completion_tokens"] == sum(u.completion_tokens for u in mine)
    assert "Usage by day" in run(app, "billing", "report")
    csv_file = tmp_path / "r.csv"
    run(app, "billing", "report", "--format", "csv", "--output", str(csv_file))
    assert csv_file.read_text().startswith("section,key,requests")
    png = tmp_path / "r.png"
    run(app, "billing", "report", "--since", "2026-01-01", "--format", "png", "--output", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_line_and_exit_code_2(cli_env: str) -> None:
    app = make_app()
    run(app, "migrate")
    run(app, "tenants", "create", "acme")
    cases = [
        ("tenants", "create", "acme"),  # taken
        ("tenants", "create", "x", "--monthly-budget", "lots"),
        ("keys", "create", "--tenant", "nobody"),
        ("keys", "revoke", "key_nope"),
        ("billing", "report", "--since", "yesterday"),
        ("billing", "report", "--format", "pdf"),
        ("billing", "report", "--format", "png"),
        ("billing", "report", "--tenant", "nobody"),
        ("prices", "set", "m", "--input", "-1", "--cached-input", "0", "--output", "0"),
        ("prices", "set", "m", "--input", "1", "--cached-input", "0", "--output", "0",
         "--batch-discount", "1.5"),
    ]  # fmt: skip
    for args in cases:
        out = run(app, *args, code=2)
        assert out.startswith("error: ") and out.count("\n") == 1, (args, out)


def test_every_command_has_help() -> None:
    app = make_app()
    for args in [("migrate",), ("tenants", "create"), ("tenants", "list"), ("keys", "create"),
                 ("keys", "list"), ("keys", "revoke"), ("billing", "report"), ("prices", "set"),
                 ("prices", "list")]:  # fmt: skip
        assert "Usage:" in run(app, *args, "--help")
