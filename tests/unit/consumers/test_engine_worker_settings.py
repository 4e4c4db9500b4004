"""EngineWorkerSettings → EngineWorkerConfig, as the composition root builds it."""

from __future__ import annotations

import pytest

from sluice.bus.topics import Lane
from sluice.consumers.engine_worker import EngineWorkerConfig
from sluice.settings import EngineWorkerSettings, SettingsError, load_settings


def test_settings_build_the_worker_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_LANE_WEIGHT_BATCH", "2")
    monkeypatch.setenv("SLUICE_MAX_ENGINE_WAITING", "3")
    settings = load_settings(EngineWorkerSettings, drain_timeout_s=5.0)
    config = EngineWorkerConfig(**settings.worker_config_kwargs())
    assert config.lane_weights[Lane.BATCH] == 2 and config.max_engine_waiting == 3
    assert config.drain_timeout_s == 5.0 and config.group_id == "engine"


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_KV_USAGE", "1.5")
    with pytest.raises(SettingsError, match="SLUICE_MAX_KV_USAGE"):
        load_settings(EngineWorkerSettings)
