"""Native CPU kernels the engine builds on first use with the system C compiler.

`bf16_linear()` returns the AVX2 bf16-weight GEMV of `bf16_linear.c` (batch-1 decode of a
bf16 model on a CPU without native bf16), or None where it cannot run: no AVX2/FMA, no C
compiler, or a failed build (logged once; callers keep their torch path). The shared
library is cached per source hash under `$SLUICE_KERNEL_CACHE` (default
`~/.cache/sluice/kernels`), so a machine compiles it once (~1 s).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("bf16_linear.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS = 4  # the kernel handles 1..MAX_ROWS rows of x per call

Bf16Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sluice" / "kernels"
    return Path(os.environ.get("SLUICE_KERNEL_CACHE") or default)


def _cpu_has_avx2_fma() -> bool:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build(source: Path, out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *_FLAGS, str(source), "-o", tmp], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, out)  # atomic: concurrent builders each land a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def bf16_linear() -> Bf16Linear | None:
    """y[M, N] = x[M, K] @ w[N, K].T (+ bias) for fp32 x (M <= MAX_ROWS) and bf16 w."""
    if os.environ.get("SLUICE_ENGINE_KERNELS", "1") == "0" or not _cpu_has_avx2_fma():
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"bf16_linear-{digest}.so"
    try:
        if not lib_path.exists():
            _build(_SOURCE, lib_path)
        # after `import torch`, libgomp.so.1 resolves to torch's copy: one OpenMP pool
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("bf16 CPU kernel unavailable (%s) %s", e, detail.decode(errors="replace"))
        return None
    fn = lib.sluice_bf16_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int

    def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        threads = torch.get_num_threads()
        if fn(w.data_ptr(), x.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, threads) != 0:
            raise ValueError(f"bf16_linear takes 1..{MAX_ROWS} rows, got {m}")
        return y

    return run
