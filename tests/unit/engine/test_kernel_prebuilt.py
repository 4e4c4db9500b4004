"""The image's CPU kernels (Dockerfile): its builder stage compiles them into a directory
as root; its runtime stage, with no compiler and as another user, loads them from there
through SLUICE_KERNEL_CACHE instead of logging "CPU kernels unavailable"."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine import kernels
from tests.unit.deploy.sluice_checks import dockerfile_env
from tests.unit.engine.test_kernel_fallbacks import needs_build

DOCKERFILE = Path(__file__).resolve().parents[3] / "Dockerfile"

# the runtime stage's composition root, as `sluice worker engine` runs it: settings from
# the environment, the engine's process options applied, then the kernels
RUNTIME = """
from sluice import wiring
from sluice.engine.backends.torch_backend import apply_process_options
from sluice.engine.kernels import cpu_ops
from sluice.settings import EngineWorkerSettings, load_settings

apply_process_options(wiring.engine_options(load_settings(EngineWorkerSettings)))
print("kernels loaded" if cpu_ops() is not None else "no kernels")
"""


def _builder_cache() -> str:
    """The directory the builder stage's `load_cpu_ops(Path(...))` builds into."""
    text = DOCKERFILE.read_text().replace("\\\n", "")
    [path] = re.findall(r"load_cpu_ops\(Path\('([^']+)'\)\)", text)
    return path


def test_the_runtime_stage_looks_where_the_builder_stage_builds() -> None:
    assert dockerfile_env(DOCKERFILE)["SLUICE_KERNEL_CACHE"] == _builder_cache()


@needs_build
def test_a_built_library_is_readable_and_executable_by_every_user(tmp_path: Path) -> None:
    assert kernels.load_cpu_ops(tmp_path) is not None
    mode = kernels.library_path(tmp_path).stat().st_mode
    assert mode & 0o555 == 0o555, oct(mode)


@needs_build
def test_a_prebuilt_library_loads_where_no_compiler_is(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    assert kernels.load_cpu_ops(cache) is not None  # the builder stage
    no_tools = tmp_path / "bin"
    no_tools.mkdir()
    env = {
        "PATH": str(no_tools),  # no gcc, no cc: a rebuild could only fail
        "HOME": str(tmp_path / "home"),  # whose ~/.cache holds no kernels
        "SLUICE_KERNEL_CACHE": str(cache),
        "SLUICE_MODEL": "tiny-llama",
    }
    done = subprocess.run(
        [sys.executable, "-c", RUNTIME], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kernels loaded", done.stderr
    assert "CPU kernels unavailable" not in done.stderr


@pytest.mark.parametrize("prebuilt", [False, True])
def test_the_image_check_passes_only_on_kernels_that_load(tmp_path: Path, prebuilt: bool) -> None:
    """The runtime stage's own check: nothing built (a builder without AVX2) passes."""
    if prebuilt and not kernels.load_cpu_ops(tmp_path):
        pytest.skip("no AVX2/FMA or no compiler: nothing to prebuild")
    text = DOCKERFILE.read_text().replace("\\\n", "")
    [check] = re.findall(r'^RUN python -c "(.*library_path.*)"$', text, re.MULTILINE)
    check = check.replace("/opt/sluice/kernels", str(tmp_path))
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
