"""Builds cpu_ops.c into a shared library cached per source hash, and loads it once per
process (`cpu_ops`), or says once why it cannot (`load_cpu_ops` returns None)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from sluice.engine.kernels import config
from sluice.engine.kernels.bindings import CpuOps
from sluice.engine.options import EngineOptions

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-pthread", "-fopenmp", "-shared", "-fPIC")


class _Unavailable(Exception):
    """Why the kernels cannot run here; `load_cpu_ops` logs it once and returns None."""


def configure(options: EngineOptions) -> None:
    """Use `options` (kernels on or off, cache dir, parallel threshold) from now on in this
    process; a composition root calls it before the model loads."""
    config.set_options(options)
    cpu_ops.cache_clear()


def cache_dir() -> Path:
    """`EngineOptions.kernel_cache_dir`, else `~/.cache/sluice/kernels`; raises
    `_Unavailable` when neither is set and the home directory cannot be resolved (no HOME,
    no passwd entry)."""
    configured = config.options().kernel_cache_dir
    if configured:
        return configured
    try:
        return Path.home() / ".cache" / "sluice" / "kernels"
    except (RuntimeError, KeyError, OSError) as e:
        raise _Unavailable(f"no kernel cache dir: home unresolvable ({e})") from e


def library_path(cache: Path) -> Path:
    """The cached library for this source and these flags in `cache`."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return cache / f"cpu_ops-{digest}.so"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's flags from `cpuinfo` (the text of /proc/cpuinfo, read when None); empty
    when torch itself runs without AVX2 (then neither would these kernels' callers)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return set()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _build(source: Path, out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise _Unavailable("no C compiler (gcc/cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *_FLAGS, str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        # mkstemp made the file 0600 and the linker only adds x: a library built for the
        # machine (an image's builder runs as root, its engine as another user) must be
        # readable by every user, or theirs falls back with no compiler to rebuild it
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: concurrent builders each land a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(lib_path: Path, bf16_dot: bool, vnni: bool) -> CpuOps:
    """The library at `lib_path`, built first if absent, rebuilt once if the cached file
    does not load (truncated, foreign, missing a symbol)."""
    if not lib_path.exists():
        _build(_SOURCE, lib_path)
        return CpuOps(ctypes.CDLL(str(lib_path)), bf16_dot=bf16_dot, vnni=vnni)
    try:
        return CpuOps(ctypes.CDLL(str(lib_path)), bf16_dot=bf16_dot, vnni=vnni)
    except (OSError, AttributeError) as e:
        logger.warning("cached CPU kernels %s do not load (%s); rebuilding", lib_path, e)
    _build(_SOURCE, lib_path)
    return CpuOps(ctypes.CDLL(str(lib_path)), bf16_dot=bf16_dot, vnni=vnni)


def load_cpu_ops(cache: Path | None = None, cpuinfo: str | None = None) -> CpuOps | None:
    """The kernels, built into (or reused from) `cache` (`cache_dir()` when None), or None
    after one warning when they cannot run here: a CPU without AVX2/FMA (`cpuinfo`: the
    text of /proc/cpuinfo, read when None), no home to cache under, no C compiler, a cache
    dir that cannot be written, a failed build. Callers keep their torch path then.

    Under CI on x86-64 a failed build is a broken kernel, not a fallback:
    tests/unit/engine/test_kernel_fallbacks.py::test_kernels_build_here_in_ci fails."""
    try:
        flags = cpu_flags(cpuinfo)
        missing = {"avx2", "fma"} - flags
        if missing:
            raise _Unavailable(f"this CPU lacks {', '.join(sorted(missing))}")
        vnni = {"avx512_vnni", "avx512vl", "avx512bw"} <= flags
        return _load(library_path(cache or cache_dir()), "avx512_bf16" in flags, vnni)
    except (_Unavailable, OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning(
            "CPU kernels unavailable (%s), using the torch path %s",
            e,
            detail.decode(errors="replace"),
        )
        return None


@functools.cache
def cpu_ops() -> CpuOps | None:
    """`load_cpu_ops()` once per process (per `configure`); None without a word when the
    options turn the kernels off."""
    if not config.options().kernels:
        return None
    return load_cpu_ops()
