"""EngineWorkerSettings → EngineWorkerConfig, as the composition root builds it."""

from __future__ import annotations

import os

import pytest

from sluice.bus.topics import Lane
from sluice.consumers.engine_worker import EngineWorkerConfig
from sluice.engine.config import EngineConfig
from sluice.settings import ENV_PREFIX, EngineWorkerSettings, SettingsError, load_settings


def test_settings_build_the_worker_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_LANE_WEIGHT_BATCH", "2")
    monkeypatch.setenv("SLUICE_MAX_ENGINE_WAITING", "3")
    settings = load_settings(EngineWorkerSettings, drain_timeout_s=5.0)
    config = settings.worker_config()
    assert config.lane_weights[Lane.BATCH] == 2 and config.max_engine_waiting == 3
    assert config.drain_timeout_s == 5.0 and config.group_id == "engine"


def test_unset_settings_build_the_configs_own_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    settings = load_settings(EngineWorkerSettings)
    assert settings.worker_config() == EngineWorkerConfig()
    assert settings.engine_config(device="cpu", dtype="float32") == EngineConfig()


def test_renamed_settings_fill_their_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_ENGINE_GROUP_ID", "engine-b")
    monkeypatch.setenv("SLUICE_POLL_MAX_RECORDS", "7")
    monkeypatch.setenv("SLUICE_REPLY_INTERVAL_MS", "25")
    config = load_settings(EngineWorkerSettings).worker_config()
    assert (config.group_id, config.max_records, config.reply_interval_s) == ("engine-b", 7, 0.025)


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_KV_USAGE", "1.5")
    with pytest.raises(SettingsError, match="SLUICE_MAX_KV_USAGE"):
        load_settings(EngineWorkerSettings)
