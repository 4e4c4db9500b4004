"""`sluice up` without SLUICE_DATABASE_URL admits against the data dir's tenants.

The tenants `sluice tenants create` wrote to the data dir's SQLite are the ones the
gateway `up` starts authenticates and limits, as `sluice serve` does: the static key stops
working once a tenant exists, the tenant's key works, and its limits hold. The stack
itself is not started: `up`'s supervisor is replaced by a recorder of what it would run,
and the gateway is built by the same wiring its process runs, on the in-memory bus.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import sluice.up
from sluice import wiring
from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.cli import app as cli_app
from sluice.settings import GatewaySettings, load_settings
from tests.unit.api.fakes import FakeEngineWorker, served_model

runner = CliRunner()
STATIC = "sk-static-up-test"


@pytest.fixture(autouse=True)
def no_services(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("SLUICE_DATABASE_URL", "SLUICE_REDIS_URL", "SLUICE_CELERY_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path / "default"))
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", "127.0.0.1:1")


@pytest.fixture
def bus() -> Iterator[MemoryEventBus]:
    bus = MemoryEventBus()
    bus.create_topics(
        TopicLayout(request_partitions=2, tokens_partitions=1, pools=("tiny",)).specs()
    )
    engine = FakeEngineWorker(bus).start()
    yield bus
    engine.stop()
    bus.close()


def up_gateway_args(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> tuple[list[str], str]:
    """The `sluice gateway` arguments `sluice up --data-dir` would start, and its output."""
    started: list[Sequence[str]] = []

    def record(gateway_args: Sequence[str], *args: Any, **kwargs: Any) -> int:
        started.append(gateway_args)
        kwargs["on_ready"]()  # what the children's /readyz answering 200 triggers
        return 0

    monkeypatch.setattr(sluice.up, "run_up", record)
    args = ["up", "--data-dir", str(data_dir), "--api-key", STATIC]
    result = runner.invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    return list(started[0]), result.output


def test_up_admits_against_the_tenants_of_its_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bus: MemoryEventBus
) -> None:
    data_dir = tmp_path / "data"
    created = runner.invoke(
        cli_app,
        ["tenants", "create", "load", "--max-concurrency", "1", "--json",
         "--data-dir", str(data_dir)],
    )  # fmt: skip
    assert created.exit_code == 0, created.output
    tenant_key = json.loads(created.output)["api_key"]
    gateway_args, output = up_gateway_args(monkeypatch, data_dir)
    assert "tenant keys only" in output and STATIC not in output
    assert gateway_args[gateway_args.index("--data-dir") + 1] == str(data_dir)

    # what the gateway process builds from those arguments (`sluice gateway`)
    settings = load_settings(GatewaySettings, data_dir=data_dir, api_keys=[STATIC])
    assert settings.database_url is None
    admission = wiring.open_tenancy(settings, embedded=False)
    try:
        gateway = create_app(settings, bus, [served_model("tiny")], admission=admission)
        with TestClient(gateway) as client:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            r = client.post("/v1/completions", json=body, headers=_auth(STATIC))
            assert r.status_code == 401, r.text
            r = client.post("/v1/completions", json=body, headers=_auth(tenant_key))
            assert r.status_code == 200, r.text
            two = {**body, "prompt": ["hi", "yo"]}  # two concurrent requests, limit 1
            r = client.post("/v1/completions", json=two, headers=_auth(tenant_key))
            assert r.status_code == 400 and "max_concurrency" in r.text, r.text
    finally:
        admission.close()


def test_up_with_an_empty_data_dir_still_takes_its_static_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data_dir = tmp_path / "fresh"
    _, output = up_gateway_args(monkeypatch, data_dir)
    assert f"api key: {STATIC}" in output
    assert (data_dir / "sluice.db").stat().st_mode & 0o777 == 0o600  # migrated, owner-only


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
