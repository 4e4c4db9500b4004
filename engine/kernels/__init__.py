"""Native CPU kernels for decode steps, built on first use with the system C compiler.

`cpu_ops()` returns the `CpuOps` of `cpu_ops.c` (AVX2 + FMA), or None where they cannot
run (one warning, see `load_cpu_ops`) or when `EngineOptions.kernels` is off. Callers keep
their torch path then. The shared library is cached per source hash under
`EngineOptions.kernel_cache_dir` (default `~/.cache/sluice/kernels`), so a machine compiles it once
(about a second). The bf16 GEMV uses AVX512-BF16 where the CPU has it (a function-level
target, chosen at run time), and so does `attn_paged`, the decode attention of large and
mixed steps, which runs on torch's own OpenMP threads (`-fopenmp`: the process has one
libgomp). The int8 GEMV (int8 weights, x quantized to int16 per row) serves the decode
steps of int8 models.

Why: a batch-1 decode step of the bench model is ~35 small torch ops per layer, each paying
microseconds of dispatch (benchmarks/RESULTS.md), around GEMVs that torch runs below memory
speed for bf16 weights without native bf16. Here each small op is one call, a step's
layers are one call together (`decode_layers`: the Python around ~10 calls a layer cost
~0.7 ms a token), and the GEMVs stream their weights once for up to MAX_ROWS rows. In
larger steps of a bf16 model the bf16 small ops (RMSNorm, RoPE, SiLU*up) and `attn_paged`
replace several torch ops each and the gather of every request's padded keys
(benchmarks/RESULTS.md, Engine).
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.engine.options import EngineOptions

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-pthread", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS = 4  # the bf16 GEMV serves 1..MAX_ROWS rows of x per call
# Below `EngineOptions.kernel_parallel_min_work` multiply-adds a kernel runs on the calling
# thread alone (sharing costs more than it saves). Above it the calling thread shares chunks
# with persistent helper threads (`parallel_for` in cpu_ops.c, torch.get_num_threads() in
# all) and never waits for a helper that is off its core: two threads stream weights from
# DRAM about twice as fast as one (benchmarks/RESULTS.md).
# The process's options (one library per process): the composition root sets them with
# `configure` (through `engine.options.apply_process_options`) before the model loads.
_options = EngineOptions()

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "sluice_bf16_linear": (
        [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int],
        ctypes.c_int,
    ),
    "sluice_int8_linear": (
        [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int],
        ctypes.c_int,
    ),
    "sluice_rms_norm": ([_P, _P, ctypes.c_float, _P, _I, _I], None),
    "sluice_rope": ([_P, _I, _I, _P, _P, _I, _I], None),
    "sluice_silu_mul": ([_P, _P, _I, _I], None),
    "sluice_attn_decode": (
        [_P, _I, _P, _P, _P, _I, _P, *[_I] * 6, ctypes.c_float, _P, ctypes.c_int, ctypes.c_int],
        ctypes.c_int,
    ),
    "sluice_decode_layers": ([_P, _P, _P, _I, _P, _P, _P, _I, _P], ctypes.c_int),
    "sluice_rms_norm_bf16": ([_P, _P, ctypes.c_float, _P, _I, _I, ctypes.c_int], None),
    "sluice_silu_mul_bf16": ([_P, _P, _I, _I, ctypes.c_int], None),
    "sluice_add_bf16": ([_P, _P, _I, _I, ctypes.c_int], None),
    "sluice_argmax_bf16": ([_P, _I, _I, _P, ctypes.c_int], None),
    "sluice_rope_bf16": ([_P, _I, _I, _P, _P, _I, _I, ctypes.c_int], None),
    "sluice_attn_paged": (
        [_P, _I, ctypes.c_int, _P, _P, _P, _I, _I, _P, _P, *[_I] * 6, ctypes.c_float, ctypes.c_int],
        ctypes.c_int,
    ),
}


class _Proj(ctypes.Structure):
    _fields_ = [
        ("w", _P), ("scale", _P), ("bias", _P), ("N", _I), ("K", _I),
        ("int8", ctypes.c_int32), ("mode", ctypes.c_int32),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _P), ("post_norm", _P), ("qkv", _Proj), ("o", _Proj),
        ("gate_up", _Proj), ("down", _Proj), ("cache", _P), ("window", _I),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _I), ("H", _I), ("I", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("bs", _I),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("rope", _P),
        ("cache_bf16", ctypes.c_int32), ("threads", ctypes.c_int32), ("min_work", _I),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class ProjWeights:
    """One projection as the kernels take it: bf16 `weight` (`round_x`: x rounded to bf16
    first, see `CpuOps.bf16_linear`) or int8 `weight` with fp32 `scale` per row; fp32 bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: torch.Tensor | None = None
    round_x: bool = False


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """What `CpuOps.decode_layers` reads of one decoder layer (fp32 norm weights)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: ProjWeights
    o: ProjWeights
    gate_up: ProjWeights
    down: ProjWeights
    window: int | None


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """A runner's layers and KV caches for `CpuOps.decode_layers`, built once
    (`CpuOps.decode_plan`); it holds the tensors whose addresses the C structs keep."""

    model: _Model
    layers: ctypes.Array[_Layer]
    keep: tuple[object, ...]


def configure(options: EngineOptions) -> None:
    """Use `options` (kernels on or off, cache dir, parallel threshold) from now on in this
    process; a composition root calls it before the model loads."""
    global _options
    _options = options
    cpu_ops.cache_clear()


def _threads(work: int) -> int:
    return torch.get_num_threads() if work >= _options.kernel_parallel_min_work else 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuOps:
    """Typed wrappers over the library; tensors are CPU, contiguous, fp32 unless noted.

    `bf16_dot`: the CPU has AVX512-BF16, which `bf16_linear(round_x=True)` uses."""

    def __init__(self, lib: ctypes.CDLL, bf16_dot: bool = False) -> None:
        self.bf16_dot = bf16_dot
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._linear = lib.sluice_bf16_linear
        self._int8_linear = lib.sluice_int8_linear
        self._rms_norm = lib.sluice_rms_norm
        self._rope = lib.sluice_rope
        self._silu_mul = lib.sluice_silu_mul
        self._attn = lib.sluice_attn_decode
        self._paged = lib.sluice_attn_paged
        self._rms_norm_bf16 = lib.sluice_rms_norm_bf16
        self._decode_layers = lib.sluice_decode_layers
        self._silu_mul_bf16 = lib.sluice_silu_mul_bf16
        self._add_bf16 = lib.sluice_add_bf16
        self._rope_bf16 = lib.sluice_rope_bf16
        self._argmax_bf16 = lib.sluice_argmax_bf16

    def linear(
        self, x: torch.Tensor, proj: ProjWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ `proj`.T (+ bias) -> fp32 [M, N], M <= MAX_ROWS; with `out`, adds to
        it. A bf16 weight takes fp32 x (rounded to bf16 first with `round_x`); an int8 one
        quantizes each x row to int16 with one scale in the kernel (see cpu_ops.c)."""
        m, k = x.shape
        n = proj.weight.shape[0]
        y = out if out is not None else torch.empty((m, n), dtype=torch.float32)
        threads, acc = _threads(m * n * k), int(out is not None)
        w, bias = proj.weight.data_ptr(), _ptr(proj.bias)
        if proj.scale is not None:
            rc = self._int8_linear(
                w, proj.scale.data_ptr(), x.data_ptr(), bias, y.data_ptr(), m, n, k, threads, acc
            )
        else:
            mode = self._mode(proj.round_x)
            rc = self._linear(w, x.data_ptr(), bias, y.data_ptr(), m, n, k, threads, acc, mode)
        if rc != 0:
            raise ValueError(f"the kernels' linear takes 1..{MAX_ROWS} rows, got {m}")
        return y

    def _mode(self, round_x: bool) -> int:
        """sluice_bf16_linear's mode: 0 exact fp32 x; x rounded to bf16, then 1 VDPBF16PS
        (AVX512-BF16) or 2 the widening path (the same values without it)."""
        return (1 if self.bf16_dot else 2) if round_x else 0

    def bf16_linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
        round_x: bool = False,
    ) -> torch.Tensor:
        """`linear` of a bf16 `w`. `round_x`: x is rounded to bf16 first, as a model
        computing in bf16 rounds its matmul inputs (the products are then exact,
        accumulated in fp32); without it x stays fp32."""
        return self.linear(x, ProjWeights(w, bias, round_x=round_x), out)

    def int8_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear` of an int8 `qweight` [N, K] with fp32 `scale` [N] per row."""
        return self.linear(x, ProjWeights(qweight, bias, scale=scale), out)

    def decode_plan(
        self,
        layers: Sequence[LayerWeights],
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        eps: float,
        rope: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
    ) -> DecodePlan:
        """The C description of `layers` (each with its KV cache, bf16 or fp32) and `rope`
        (fp32 pairs [positions, head_dim/2, 2]) for `decode_layers`."""

        def proj(p: ProjWeights) -> _Proj:
            mode = self._mode(p.round_x)
            return _Proj(
                p.weight.data_ptr(), _ptr(p.scale), _ptr(p.bias), p.weight.shape[0],
                p.weight.shape[1], int(p.scale is not None), mode,
            )  # fmt: skip

        array = (_Layer * len(layers))(
            *(
                _Layer(
                    lw.in_norm.data_ptr(),
                    lw.post_norm.data_ptr(),
                    proj(lw.qkv),
                    proj(lw.o),
                    proj(lw.gate_up),
                    proj(lw.down),
                    cache.data_ptr(),
                    lw.window or 0,
                )
                for lw, cache in zip(layers, kv_caches, strict=True)
            )
        )
        first = layers[0]
        model = _Model(
            len(layers), first.in_norm.shape[0], first.down.weight.shape[1], heads, kv_heads,
            head_dim, block_size, eps, head_dim**-0.5, rope.data_ptr(),
            int(kv_caches[0].dtype == torch.bfloat16), 1, 0,
        )  # fmt: skip
        return DecodePlan(model, array, (tuple(layers), tuple(kv_caches), rope))

    def decode_layers(
        self,
        plan: DecodePlan,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        num_keys: torch.Tensor,
    ) -> None:
        """Every layer of `plan` on fp32 h [M, H] (M <= MAX_ROWS decoding requests), in
        place: `DecoderLayer.forward_decode` layer after layer, bit for bit."""
        plan.model.threads = torch.get_num_threads()
        plan.model.min_work = _options.kernel_parallel_min_work
        rc = self._decode_layers(
            ctypes.byref(plan.model), plan.layers, h.data_ptr(), h.shape[0],
            positions.data_ptr(), slots.data_ptr(), table.data_ptr(), table.shape[1],
            num_keys.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_layers failed ({rc}): keys beyond the block table?")

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(h)
        self._rms_norm(h.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), h.shape[0], h.shape[1])
        return out

    def rope_(self, x: torch.Tensor, heads: int, table: torch.Tensor, pos: torch.Tensor) -> None:
        """Rotate the first `heads` heads of each row of `x` [M, >= heads*D] (rows contiguous,
        (re, im) pairs) by `table` [positions, D/2, 2] at int64 `pos` [M], in place."""
        half = table.shape[1]
        self._rope(x.data_ptr(), x.stride(0), x.shape[0], table.data_ptr(), pos.data_ptr(),
                   heads, half)  # fmt: skip

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        m, two_i = gu.shape
        out = torch.empty((m, two_i // 2), dtype=torch.float32)
        self._silu_mul(gu.data_ptr(), out.data_ptr(), m, two_i // 2)
        return out

    def attn_decode(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        num_keys: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """Rows of `qkv` [P, (Hq + 2*Hkv)*D] are q | K | V of one decoding request each:
        write K|V into `slots`, then attend q over each request's keys (block `table`
        [P, nblk] int64, `num_keys` [P] int64) -> [P, Hq*D]. The cache is fp32 or bf16."""
        if kv_cache.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"attn_decode takes an fp32 or bf16 cache, got {kv_cache.dtype}")
        p = qkv.shape[0]
        _, bs, _, hkv, d = kv_cache.shape
        out = torch.empty((p, num_heads * d), dtype=torch.float32)
        rc = self._attn(
            qkv.data_ptr(), qkv.stride(0), kv_cache.data_ptr(), slots.data_ptr(),
            table.data_ptr(), table.shape[1], num_keys.data_ptr(), window or 0,
            p, num_heads, hkv, d, bs, d**-0.5, out.data_ptr(),
            # shared whenever there are tasks to share: the helpers still spin from the
            # qkv GEMV (as in sluice_decode_layers)
            torch.get_num_threads() if p * hkv > 1 else 1,
            int(kv_cache.dtype == torch.bfloat16),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"attn_decode failed ({rc}): keys beyond the block table?")
        return out

    def attn_paged(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        table: torch.Tensor,
        num_keys: torch.Tensor,
        window: int | None,
        requests: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [P, Hq, D] (bf16 or fp32, rows may be strided: a view of the qkv output), one
        query token a row whose K|V are already in the bf16 cache, attends to its keys:
        the first `num_keys` [P] int64 of block table row `requests[p]` (`table` [R, nblk]
        int64; row p when `requests` is None) -> [P, Hq, D] in q's dtype. Rows are
        decoding requests, or a prefill chunk's tokens (keys: position + 1). Needs
        `bf16_dot` (AVX512-BF16), D a multiple of 32, Hq / Hkv <= 16."""
        p, hq, d = q.shape
        _, bs, _, hkv, _ = kv_cache.shape
        if not self.bf16_dot or kv_cache.dtype != torch.bfloat16 or q.stride()[1:] != (d, 1):
            raise TypeError("attn_paged takes a bf16 cache and q with contiguous heads")
        out = torch.empty((p, hq, d), dtype=q.dtype)
        rc = self._paged(
            q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), out.data_ptr(),
            kv_cache.data_ptr(), table.data_ptr(), table.shape[0], table.shape[1],
            _ptr(requests), num_keys.data_ptr(), window or 0, p, hq, hkv, d, bs, d**-0.5,
            _threads(p * hq * d * table.shape[1] * bs * 2),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"attn_paged failed ({rc}): keys beyond the block table?")
        return out

    # The bf16 small ops (need `bf16_dot`; widths multiples of 16): one pass each where
    # torch takes several ops, with torch's roundings (see cpu_ops.c).

    def rms_norm_bf16(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """fp32 h [M, H] -> bf16 RMSNorm(h) * weight (fp32 weight [H])."""
        m, n = h.shape
        out = torch.empty((m, n), dtype=torch.bfloat16)
        self._rms_norm_bf16(
            h.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), m, n, _small_op_threads(m * n)
        )
        return out

    def silu_mul_bf16(self, gu: torch.Tensor) -> torch.Tensor:
        """bf16 gu [M, 2I] -> bf16 SiLU(gu[:, :I]) * gu[:, I:]."""
        m, two_i = gu.shape
        out = torch.empty((m, two_i // 2), dtype=torch.bfloat16)
        self._silu_mul_bf16(
            gu.data_ptr(), out.data_ptr(), m, two_i // 2, _small_op_threads(m * two_i)
        )
        return out

    def add_bf16_(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """fp32 h [M, H] += bf16 y [M, H] (both contiguous), in place: `h.add_(y)`."""
        m, n = h.shape
        self._add_bf16(h.data_ptr(), y.data_ptr(), m, n, _small_op_threads(m * n))
        return h

    def argmax_bf16(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [M]: each bf16 row's first maximum (or first NaN), as numpy's argmax of
        the row in fp32 (`engine.sampler.greedy_tokens`), without the fp32 copy."""
        logits = logits.contiguous()
        m, n = logits.shape
        out = torch.empty(m, dtype=torch.int64)
        self._argmax_bf16(logits.data_ptr(), m, n, out.data_ptr(), _small_op_threads(m * n))
        return out

    def rope_bf16_(
        self, x: torch.Tensor, heads: int, table: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """`rope_` for bf16 rows of `x` (heads' last dim contiguous), in place."""
        half = table.shape[1]
        self._rope_bf16(x.data_ptr(), x.stride(0), x.shape[0], table.data_ptr(), pos.data_ptr(),
                        heads, half, _small_op_threads(x.shape[0] * heads * half * 2))  # fmt: skip


# elements from which the bf16 small ops run on torch's OpenMP threads
SMALL_OP_PARALLEL_MIN = 32 << 10


def _small_op_threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= SMALL_OP_PARALLEL_MIN else 1


class _Unavailable(Exception):
    """Why the kernels cannot run here; `load_cpu_ops` logs it once and returns None."""


def cache_dir() -> Path:
    """`EngineOptions.kernel_cache_dir`, else `~/.cache/sluice/kernels`; raises
    `_Unavailable` when neither is set and the home directory cannot be resolved (no HOME,
    no passwd entry)."""
    configured = _options.kernel_cache_dir
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


def _cpu_flags(cpuinfo: str | None = None) -> set[str]:
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
        os.replace(tmp, out)  # atomic: concurrent builders each land a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(lib_path: Path, bf16_dot: bool) -> CpuOps:
    """The library at `lib_path`, built first if absent, rebuilt once if the cached file
    does not load (truncated, foreign, missing a symbol)."""
    if not lib_path.exists():
        _build(_SOURCE, lib_path)
        return CpuOps(ctypes.CDLL(str(lib_path)), bf16_dot=bf16_dot)
    try:
        return CpuOps(ctypes.CDLL(str(lib_path)), bf16_dot=bf16_dot)
    except (OSError, AttributeError) as e:
        logger.warning("cached CPU kernels %s do not load (%s); rebuilding", lib_path, e)
    _build(_SOURCE, lib_path)
    return CpuOps(ctypes.CDLL(str(lib_path)), bf16_dot=bf16_dot)


def load_cpu_ops(cache: Path | None = None, cpuinfo: str | None = None) -> CpuOps | None:
    """The kernels, built into (or reused from) `cache` (`cache_dir()` when None), or None
    after one warning when they cannot run here: a CPU without AVX2/FMA (`cpuinfo`: the
    text of /proc/cpuinfo, read when None), no home to cache under, no C compiler, a cache
    dir that cannot be written, a failed build. Callers keep their torch path then.

    Under CI on x86-64 a failed build is a broken kernel, not a fallback:
    tests/unit/engine/test_kernel_fallbacks.py::test_kernels_build_here_in_ci fails."""
    try:
        flags = _cpu_flags(cpuinfo)
        missing = {"avx2", "fma"} - flags
        if missing:
            raise _Unavailable(f"this CPU lacks {', '.join(sorted(missing))}")
        return _load(library_path(cache or cache_dir()), bf16_dot="avx512_bf16" in flags)
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
    if not _options.kernels:
        return None
    return load_cpu_ops()
