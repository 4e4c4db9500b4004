"""Batches in distributed mode: which process runs the batch steps, and the refusals of
`sluice worker batches` / `batches-beat` without their services (no services needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice import wiring
from sluice.billing.admission import open_admission
from sluice.bus.memory import MemoryEventBus
from sluice.cli import app
from sluice.cli_serving import _side_workers
from sluice.consumers.batches.tasks import CeleryBatches, InProcessBatches
from sluice.settings import GatewaySettings, Settings, load_settings
from tests.unit.api.fakes import served_model

runner = CliRunner()
DATABASE = "postgresql+psycopg://u@127.0.0.1:1/sluice"
REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture(autouse=True)
def no_services(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("SLUICE_DATABASE_URL", "SLUICE_REDIS_URL", "SLUICE_CELERY_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", "127.0.0.1:1")


def test_the_batches_worker_refuses_to_start_without_its_database_and_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = runner.invoke(app, ["worker", "batches"])
    assert result.exit_code == 2
    assert "set SLUICE_DATABASE_URL" in result.output
    monkeypatch.setenv("SLUICE_DATABASE_URL", DATABASE)
    result = runner.invoke(app, ["worker", "batches"])
    assert result.exit_code == 2
    assert "set SLUICE_CELERY_BROKER_URL (or SLUICE_REDIS_URL" in result.output
    result = runner.invoke(app, ["worker", "batches-beat"])
    assert result.exit_code == 2
    assert "batches beat needs a Celery broker" in result.output


def test_up_starts_the_batches_worker_and_beat_with_a_database_and_a_broker() -> None:
    model, data = ["--model", "tiny-llama"], ["--data-dir", "/d"]

    def names(**stores: str) -> list[str]:
        return [n for n, _ in _side_workers(load_settings(Settings, **stores), model, data)]

    assert names() == ["billing"]
    assert names(database_url=DATABASE) == ["billing"]  # the gateway runs the steps
    assert names(redis_url=REDIS) == ["billing", "quotas"]
    everything = _side_workers(
        load_settings(Settings, database_url=DATABASE, redis_url=REDIS), model, data
    )
    assert dict(everything) == {
        "billing": ["worker", "billing", *data],
        "quotas": ["worker", "quotas", *data],
        "batches": ["worker", "batches", *model],  # it needs the model's tokenizer
        "batches-beat": ["worker", "batches-beat", *data],
    }


@pytest.fixture
def bus() -> Iterator[MemoryEventBus]:
    bus = MemoryEventBus()
    yield bus
    bus.close()


def test_the_gateway_sends_batch_steps_to_celery_or_runs_them_itself(
    tmp_path: Path, bus: MemoryEventBus
) -> None:
    models = [served_model("tiny")]
    no_database = load_settings(GatewaySettings)
    assert wiring.gateway_batches(no_database, bus, models, None) is None  # routes say 503
    admission = open_admission(database_url=None, redis_url=None, data_dir=tmp_path)
    try:
        with_broker = load_settings(
            GatewaySettings,
            celery_broker_url="memory://",
            database_url="postgresql+psycopg://sluice@db/sluice",
        )
        celery = wiring.gateway_batches(with_broker, bus, models, admission)
        assert isinstance(celery, CeleryBatches)
        assert celery.store.db is admission.auth.db
        wiring.stop_batches(celery)
        # `sluice worker batches` needs SLUICE_DATABASE_URL: on SQLite the gateway runs them
        sqlite = load_settings(GatewaySettings, celery_broker_url="memory://")
        on_sqlite = wiring.gateway_batches(sqlite, bus, models, admission)
        assert isinstance(on_sqlite, InProcessBatches)
        wiring.stop_batches(on_sqlite)
        alone = wiring.gateway_batches(load_settings(GatewaySettings), bus, models, admission)
        assert isinstance(alone, InProcessBatches)
        assert not alone.recover_on_start  # Kafka kept the queued lines
        wiring.stop_batches(alone)
    finally:
        admission.close()
