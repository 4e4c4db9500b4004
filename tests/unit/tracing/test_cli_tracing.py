"""`sluice worker tracing` and `sluice up` follow the OTEL_* variables."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sluice.cli import app
from sluice.cli_serving import _side_workers
from sluice.settings import Settings

OTEL = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER")


@pytest.fixture(autouse=True)
def no_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL:
        monkeypatch.delenv(name, raising=False)


def test_the_tracing_worker_without_an_exporter_says_so_and_exits_0() -> None:
    result = CliRunner().invoke(app, ["worker", "tracing"])
    assert result.exit_code == 0, result.output
    assert "no span exporter is configured" in result.output


def test_up_starts_the_tracing_worker_only_when_spans_are_exported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings()
    assert "tracing" not in [name for name, _ in _side_workers(settings, [], [])]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    workers = dict(_side_workers(settings, [], ["--data-dir", "/d"]))
    assert workers["tracing"] == ["worker", "tracing", "--data-dir", "/d"]
