"""docs/settings.md and `sluice config`, both generated from the settings classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.cli import app
from sluice.settings import EngineWorkerSettings, GatewaySettings
from sluice.settings_doc import REGENERATE, SECTIONS, render_settings_reference, rows

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "settings.md"
runner = CliRunner()


def test_docs_settings_md_is_what_the_settings_classes_generate() -> None:
    assert REFERENCE.read_text() == render_settings_reference(), (
        f"docs/settings.md is stale: run `{REGENERATE}` and commit it"
    )


def test_every_setting_has_a_description_and_one_row() -> None:
    every = set(GatewaySettings.model_fields) | set(EngineWorkerSettings.model_fields)
    listed = [row.variable for section in SECTIONS for row in rows(section)]
    assert sorted(listed) == sorted(f"SLUICE_{name.upper()}" for name in every)
    assert all(row.description for section in SECTIONS for row in rows(section))


def test_config_shows_the_value_here_beside_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_PORT", "9100")
    monkeypatch.setenv("SLUICE_DRAIN_TIMEOUT_S", "7")
    monkeypatch.setenv("COLUMNS", "160")
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 0, result.output
    port = next(line for line in result.output.splitlines() if line.startswith("SLUICE_PORT "))
    assert port.split()[1:4] == ["8000", "*", "9100"]
    assert "SLUICE_LANE_WEIGHT_BATCH" in result.output  # every setting, the worker's too


def test_config_json_lists_what_changed_and_hides_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLUICE_ADMIN_KEY", "sk-admin-secret")
    monkeypatch.setenv("SLUICE_DATABASE_URL", "postgresql+psycopg://me:hunter2@db:5432/sluice")
    result = runner.invoke(app, ["config", "--json", "--changed"])
    assert result.exit_code == 0, result.output
    assert "sk-admin-secret" not in result.output and "hunter2" not in result.output
    shown = {e["variable"]: e for e in json.loads(result.output)["settings"]}
    assert shown["SLUICE_ADMIN_KEY"]["value"] == "(set)"
    assert shown["SLUICE_DATABASE_URL"]["value"] == "postgresql+psycopg://me:***@db:5432/sluice"
    assert all(e["changed"] for e in shown.values())


def test_config_names_a_bad_variable_and_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_KV_USAGE", "2")
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 2
    assert "SLUICE_MAX_KV_USAGE='2' is invalid" in result.output
