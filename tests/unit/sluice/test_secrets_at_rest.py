"""Secrets stay out of logs and command lines; the embedded tenant store is owner-only.

`sluice up` hands the gateway its keys in the environment (a command line is readable by
any local user in `ps`, and `up` logs each child's); the data dir is 0700 and
`sluice.db` (tenants, key hashes, usage) 0600, from its first creation on.
"""

from __future__ import annotations

import json
import logging
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sluice import up as up_module
from sluice.cli import app
from sluice.cli_common import secure_data_dir
from sluice.settings import Settings
from sluice.up import Child

KEY = "sk-secret-0123456789abcdef"
runner = CliRunner()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def signals_restored() -> Iterator[None]:
    """`sluice up` installs SIGINT/SIGTERM handlers; put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


class RecordingSupervisor:
    """Stands in for `sluice.up.Supervisor`: records what it would start, starts nothing."""

    seen: list[RecordingSupervisor] = []

    def __init__(self, children: list[Child], env: dict[str, str], restart: bool = True) -> None:
        self.children = children
        self.env = env
        RecordingSupervisor.seen.append(self)

    def stop(self) -> None:
        pass

    def run(self) -> int:
        return 0


def test_up_gives_the_gateway_its_key_in_the_environment_never_on_a_command_line(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    signals_restored: None,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", "127.0.0.1:9")  # no broker is started
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICE_API_KEYS", raising=False)
    monkeypatch.setattr(up_module, "Supervisor", RecordingSupervisor)
    # as if the gateway and an engine worker answered /readyz at once
    monkeypatch.setattr(up_module, "call_when_ready", lambda groups, then, stopped: then())
    RecordingSupervisor.seen.clear()
    with caplog.at_level(logging.DEBUG):
        result = runner.invoke(app, ["up", "--api-key", KEY])
    assert result.exit_code == 0, result.output
    (supervisor,) = RecordingSupervisor.seen
    gateway = supervisor.children[0]
    assert gateway.name == "gateway"
    # besides its key, only its siblings' metrics URLs (for the dashboard)
    assert gateway.env.pop("SLUICE_METRICS_PEERS").startswith("http://127.0.0.1:")
    assert gateway.env == {"SLUICE_API_KEYS": KEY}
    assert all(KEY not in arg for child in supervisor.children for arg in child.argv)
    assert all("SLUICE_API_KEYS" not in child.env for child in supervisor.children[1:])
    assert KEY not in caplog.text
    assert result.stdout.count(KEY) == 1  # told once to the person who started it
    assert "--no-announce" in gateway.argv  # by `up`, not by its gateway child too


def test_a_child_starts_with_its_own_variables_and_its_log_line_has_no_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = "import os, sys; sys.exit(os.environ['SLUICE_API_KEYS'] != os.environ['EXPECTED'])"
    child = Child("gateway", [sys.executable, "-c", check], {"SLUICE_API_KEYS": KEY})
    with caplog.at_level(logging.INFO, logger="sluice.up"):
        child.start({"PATH": "/usr/bin:/bin", "EXPECTED": KEY})
    assert child.proc is not None
    assert child.proc.wait(timeout=30) == 0
    assert "started gateway" in caplog.text
    assert KEY not in caplog.text


def test_the_embedded_store_is_created_owner_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data_dir = tmp_path / "fresh" / "sluice"
    monkeypatch.setenv("SLUICE_DATA_DIR", str(data_dir))
    monkeypatch.delenv("SLUICE_DATABASE_URL", raising=False)
    result = runner.invoke(app, ["tenants", "create", "acme", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["api_key"]
    assert _mode(data_dir) == 0o700
    files = [p for p in data_dir.iterdir() if p.name.startswith("sluice.db")]
    assert {p.name for p in files} >= {"sluice.db"}
    assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}


def test_an_existing_world_readable_store_is_tightened(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data_dir = tmp_path / "old"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)
    (data_dir / "sluice.db").touch()
    (data_dir / "sluice.db").chmod(0o644)
    models = data_dir / "models"
    models.mkdir()
    models.chmod(0o755)
    secure_data_dir(Settings(data_dir=data_dir))
    assert _mode(data_dir) == 0o700
    assert _mode(data_dir / "sluice.db") == 0o600
    assert _mode(models) == 0o755  # only the dir and the store: the rest is the user's


def test_nothing_is_created_when_the_store_is_elsewhere(tmp_path: Path) -> None:
    settings: Any = Settings(data_dir=tmp_path / "unused", database_url="postgresql://u@h/db")
    secure_data_dir(settings)
    assert not (tmp_path / "unused").exists()
