"""Where the CPU decode kernels cannot run, `engine.kernels.load_cpu_ops` returns None (the
callers' torch path) after exactly one warning; a corrupt cached library is rebuilt; under
CI on x86-64 the kernels must build."""

from __future__ import annotations

import logging
import os
import platform
import pwd
import shutil
from pathlib import Path

import pytest
import torch

from sluice.engine import kernels
from sluice.engine.kernels import build, config
from sluice.engine.options import EngineOptions

HAS_AVX2 = {"avx2", "fma"} <= build.cpu_flags()
HAS_CC = bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))
needs_build = pytest.mark.skipif(not (HAS_AVX2 and HAS_CC), reason="no AVX2/FMA or no compiler")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == build.__name__ and r.levelno >= logging.WARNING
    ]


@pytest.fixture(autouse=True)
def _capture(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=build.__name__)


@pytest.fixture
def avx2_cpuinfo() -> str:
    """A /proc/cpuinfo with the flags the kernels need, so the failure under test is the
    only one (torch itself must still run with AVX2 here)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch runs without AVX2 here")
    return "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_no_compiler_falls_back_with_one_warning(
    tmp_path: Path,
    avx2_cpuinfo: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("CC", raising=False)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert kernels.load_cpu_ops(tmp_path / "cache", cpuinfo=avx2_cpuinfo) is None
    [warning] = _warnings(caplog)
    assert "no C compiler" in warning


def test_a_failing_compiler_falls_back_with_one_warning_naming_its_error(
    tmp_path: Path,
    avx2_cpuinfo: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: internal compiler error' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    cache = tmp_path / "cache"
    assert kernels.load_cpu_ops(cache, cpuinfo=avx2_cpuinfo) is None
    [warning] = _warnings(caplog)
    assert "internal compiler error" in warning
    assert list(cache.iterdir()) == []  # no half-built library left behind


def test_a_cache_dir_that_cannot_be_written_falls_back_with_one_warning(
    tmp_path: Path, avx2_cpuinfo: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a regular file: no directory can be made there, even as root (where a 0o500
    directory would not stop the write; that case is the next test's)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert kernels.load_cpu_ops(blocker / "kernels", cpuinfo=avx2_cpuinfo) is None
    assert len(_warnings(caplog)) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory")
def test_a_read_only_cache_dir_falls_back_with_one_warning(
    tmp_path: Path, avx2_cpuinfo: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o500)
    try:
        assert kernels.load_cpu_ops(cache, cpuinfo=avx2_cpuinfo) is None
    finally:
        cache.chmod(0o700)
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize(
    "cpuinfo",
    [
        "processor\t: 0\nflags\t\t: fpu sse2 avx\n",  # an x86 CPU before Haswell
        "processor\t: 0\nflags\t\t: fpu sse2 avx avx2\n",  # AVX2 without FMA
        "processor\t: 0\nFeatures\t: fp asimd\n",  # an ARM CPU: no flags line at all
    ],
)
def test_a_cpu_without_the_flags_falls_back_with_one_warning(
    tmp_path: Path, cpuinfo: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    assert kernels.load_cpu_ops(cache, cpuinfo=cpuinfo) is None
    [warning] = _warnings(caplog)
    assert "lacks" in warning
    assert not cache.exists()  # nothing built for a CPU that cannot run it


def test_an_unresolvable_home_falls_back_with_one_warning(
    avx2_cpuinfo: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No kernel cache dir configured, no HOME, and no passwd entry for this user (a container
    running under an arbitrary uid): `Path.home()` raises."""

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(config, "_options", EngineOptions(kernel_cache_dir=None))
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert kernels.load_cpu_ops(cpuinfo=avx2_cpuinfo) is None
    [warning] = _warnings(caplog)
    assert "home" in warning


@needs_build
@pytest.mark.parametrize("cached", [b"", b"\x7fELF truncated", b"not a library at all"])
def test_a_corrupt_cached_library_is_rebuilt(
    tmp_path: Path, cached: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    lib = kernels.library_path(tmp_path)
    lib.write_bytes(cached)
    ops = kernels.load_cpu_ops(tmp_path)
    assert ops is not None
    assert lib.stat().st_size > 1000  # a real library replaced the corrupt one
    [warning] = _warnings(caplog)
    assert "rebuilding" in warning
    y = ops.bf16_linear(torch.ones(1, 16), torch.ones(3, 16, dtype=torch.bfloat16), None)
    torch.testing.assert_close(y, torch.full((1, 3), 16.0))


def test_disabled_kernels_are_none_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(config, "_options", EngineOptions(kernels=False))
    assert kernels.cpu_ops.__wrapped__() is None
    assert _warnings(caplog) == []


@pytest.mark.skipif(
    os.environ.get("CI", "").lower() not in ("1", "true")
    or platform.machine().lower() not in ("x86_64", "amd64"),
    reason="only under CI on x86-64, where the kernels must build",
)
def test_kernels_build_here_in_ci(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Elsewhere a kernel that fails to build is a logged fallback; here it fails the run
    (otherwise every kernel test would skip and the torch path would hide the breakage)."""
    if not HAS_AVX2:
        pytest.skip("this CI machine's CPU lacks AVX2/FMA: the kernels cannot run, not broken")
    ops = kernels.load_cpu_ops(tmp_path)
    assert ops is not None, _warnings(caplog)
    assert _warnings(caplog) == []
