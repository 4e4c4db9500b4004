"""`--lora NAME=PATH[@BASE]` and SLUICE_LORA_MODULES: checked at start as a run-time load is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.cli import app
from sluice.settings import GatewaySettings, SettingsError, load_settings


def adapter(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_modules_are_read_checked_and_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter(tmp_path, "sql")
    adapter(tmp_path, "poem")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLUICE_LORA_MODULES", "sql=sql, poem=./poem@other")
    settings = load_settings(GatewaySettings)
    assert settings.lora_modules == [f"sql={tmp_path / 'sql'}", f"poem={tmp_path / 'poem'}@other"]
    monkeypatch.setenv("SLUICE_LORA_MODULES", "sql=missing")
    with pytest.raises(SettingsError, match=r"SLUICE_LORA_MODULES=.*sql: no adapter_config\.json"):
        load_settings(GatewaySettings)
    monkeypatch.setenv("SLUICE_LORA_MODULES", "sql")
    with pytest.raises(SettingsError, match="write NAME=PATH or NAME=PATH@BASE"):
        load_settings(GatewaySettings)


def test_a_bad_lora_flag_names_the_flag(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["gateway", "--lora", f"x={tmp_path}"])
    assert result.exit_code == 2
    assert "--lora" in result.output and "no adapter_config.json" in result.output
