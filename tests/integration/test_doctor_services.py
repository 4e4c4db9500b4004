"""`sluice doctor` against the real PostgreSQL, Redis and Kafka of this machine or CI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.cli import app
from sluice.storage.health import check_database, check_redis
from tests.services import service_missing

DATABASE_URL = os.environ.get(
    "SLUICE_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def test_doctor_passes_with_every_service_configured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kafka_bootstrap: str
) -> None:
    try:
        check_database(DATABASE_URL)
    except Exception as exc:
        service_missing(f"PostgreSQL at {DATABASE_URL}: {exc}")
    try:
        check_redis(REDIS_URL)
    except Exception as exc:
        service_missing(f"Redis at {REDIS_URL}: {exc}")
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_DATABASE_URL", DATABASE_URL)
    monkeypatch.setenv("SLUICE_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", kafka_bootstrap)
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["database"]["detail"].startswith("PostgreSQL ")
    assert checks["redis"]["detail"].startswith("Redis ")
    assert "broker" in checks["kafka"]["detail"]
