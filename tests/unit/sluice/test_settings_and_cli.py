"""Settings validation messages and the CLI commands that exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice import __version__
from sluice.cli import app
from sluice.settings import Settings, SettingsError, load_settings

runner = CliRunner()


def test_settings_read_the_sluice_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", "127.0.0.1:9092,127.0.0.2:9093")
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_DATABASE_URL", "postgresql+psycopg://u@h:5432/db")
    settings = load_settings()
    assert settings.kafka_bootstrap == "127.0.0.1:9092,127.0.0.2:9093"
    assert settings.data_dir == tmp_path
    assert load_settings(Settings, kafka_bootstrap="h:1").kafka_bootstrap == "h:1"


@pytest.mark.parametrize(
    ("var", "value", "fix"),
    [
        ("SLUICE_KAFKA_BOOTSTRAP", "localhost", "host:port"),
        ("SLUICE_KAFKA_BOOTSTRAP", "h:99999", "host:port"),
        ("SLUICE_REDIS_URL", "http://x", "redis://127.0.0.1:6379/0"),
        ("SLUICE_DATABASE_URL", "mysql://x", "postgresql+psycopg://"),
        ("SLUICE_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
        ("SLUICE_REQUEST_PARTITIONS", "0", "greater than or equal to 1"),
        ("SLUICE_TORCH_THREADS", "0", "greater than or equal to 1"),
        ("SLUICE_DTYPE", "int4", "'auto', 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, fix: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert f"{var}={value!r}" in message
    assert fix in message


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"sluice {__version__}"


def test_bad_configuration_exits_2_with_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_REDIS_URL", "nope://")
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2
    assert "SLUICE_REDIS_URL='nope://' is invalid" in result.output


def test_doctor_reports_one_line_per_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.delenv("SLUICE_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.delenv("SLUICE_DATABASE_URL", raising=False)
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False
    assert checks["redis"]["ok"] is False and "SLUICE_REDIS_URL" in checks["redis"]["fix"]
    assert checks["data dir"]["ok"] and checks["kafka"]["ok"] and checks["database"]["ok"]


def test_unbuilt_commands_do_not_appear() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("doctor", "bench"):
        assert name in result.output


def test_torch_threads_leave_a_core_on_cpu_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from sluice.settings import ModelSettings
    from sluice.wiring import resolve_torch_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert resolve_torch_threads(load_settings(ModelSettings), "cpu") == 3
    assert resolve_torch_threads(load_settings(ModelSettings), "cuda") is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert resolve_torch_threads(load_settings(ModelSettings), "cpu") == 1
    monkeypatch.setenv("SLUICE_TORCH_THREADS", "2")
    assert resolve_torch_threads(load_settings(ModelSettings), "cpu") == 2


def test_engine_cpus_take_auto_or_a_cpu_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.settings import ModelSettings

    assert load_settings(ModelSettings).engine_cpus is None
    for good in ("auto", "1-3", "0,2-3"):
        monkeypatch.setenv("SLUICE_ENGINE_CPUS", good)
        assert load_settings(ModelSettings).engine_cpus == good
    monkeypatch.setenv("SLUICE_ENGINE_CPUS", "cores 1 to 3")
    with pytest.raises(SettingsError, match="SLUICE_ENGINE_CPUS"):
        load_settings(ModelSettings)
