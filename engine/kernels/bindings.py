"""Typed ctypes bindings of cpu_ops.c (`CpuOps`): each call checks its tensors once
(`checks.tensor`), passes their pointers and sizes, and raises on the C return code."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from sluice.engine.kernels import config
from sluice.engine.kernels.checks import BF16, F32, F32_BF16, I64, bad, error, tensor
from sluice.engine.kernels.plan import (
    DecodePlan,
    LayerWeights,
    LoRAPlan,
    LoRAProj,
    LoRARows,
    ProjWeights,
    build_lora_plan,
    build_plan,
    check_proj,
)

MAX_ROWS = 4  # the bf16 GEMV serves 1..MAX_ROWS rows of x per call
# Below `EngineOptions.kernel_parallel_min_work` multiply-adds a kernel runs on the calling
# thread alone (sharing costs more than it saves). Above it the calling thread shares chunks
# with persistent helper threads (`parallel_for` in cpu_ops.c, torch.get_num_threads() in
# all) and never waits for a helper that is off its core: two threads stream weights from
# DRAM about twice as fast as one.
# elements from which the bf16 small ops run on torch's OpenMP threads
SMALL_OP_PARALLEL_MIN = 32 << 10

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_C = ctypes.c_int
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "sluice_bf16_linear": ([_P, _P, _P, _P, _I, _I, _I, _C, _C, _C], _C),
    "sluice_int8_linear": ([_P, _P, _P, _P, _P, _I, _I, _I, _C, _C], _C),
    "sluice_q_linear": ([_P, _C, _P, _P, _P, _I, _I, _I, _C, _C, _C, _C, _C], _C),
    "sluice_rms_norm": ([_P, _P, _F, _P, _I, _I], None),
    "sluice_rope": ([_P, _I, _I, _P, _P, _I, _I, _I], _C),
    "sluice_silu_mul": ([_P, _P, _I, _I], None),
    "sluice_attn_decode": ([_P, _I, _P, _I, _P, _P, _I, _P, *[_I] * 6, _F, _P, _C, _C], _C),
    "sluice_decode_layers": ([_P, _P, _P, _I, _P, _P, _P, _I, _P, _P, _P], _C),
    "sluice_lora_add": ([_P, _P, _C, _P, _C, _I, _P, _C], _C),
    "sluice_rms_norm_bf16": ([_P, _P, _F, _P, _I, _I, _C], None),
    "sluice_silu_mul_bf16": ([_P, _P, _I, _I, _C], None),
    "sluice_add_bf16": ([_P, _P, _I, _I, _C], None),
    "sluice_argmax_bf16": ([_P, _I, _I, _P, _C], None),
    "sluice_rope_bf16": ([_P, _I, _I, _P, _P, _I, _I, _I, _C], _C),
    "sluice_attn_paged": ([_P, _I, _C, _P, _P, _I, _P, _I, _I, _P, _P, *[_I] * 6, _F, _C], _C),
}


def _threads(work: int) -> int:
    return torch.get_num_threads() if work >= config.options().kernel_parallel_min_work else 1


def _small_op_threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= SMALL_OP_PARALLEL_MIN else 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _step_ids(
    op: str, rows: int, table: torch.Tensor, slots: torch.Tensor, num_keys: torch.Tensor
) -> int:
    """Checks the int64 block `table` [rows, nblk], `slots` and `num_keys` [rows]; nblk."""
    nblk = tensor(op, "table", table, I64, (rows, None))[1]
    tensor(op, "slots", slots, I64, (rows,))
    tensor(op, "num_keys", num_keys, I64, (rows,))
    return nblk


class CpuOps:
    """Typed wrappers over the library; tensors are CPU, contiguous, fp32 unless noted,
    and a call with any other raises ValueError naming the argument.

    `bf16_dot`: the CPU has AVX512-BF16, which `bf16_linear(round_x=True)`, `attn_paged`
    and the bf16 small ops use. `vnni`: it has AVX512-VNNI (with VL), which `q_linear`
    uses (VPMADDUBSW otherwise, the same sums)."""

    def __init__(self, lib: ctypes.CDLL, bf16_dot: bool = False, vnni: bool = False) -> None:
        self.bf16_dot, self.vnni = bf16_dot, vnni
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._linear = lib.sluice_bf16_linear
        self._int8_linear = lib.sluice_int8_linear
        self._q_linear = lib.sluice_q_linear
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
        self._lora_add = lib.sluice_lora_add

    def linear(
        self, x: torch.Tensor, proj: ProjWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] @ `proj`.T (+ bias) -> fp32 [M, N], M <= MAX_ROWS; with `out`, adds to
        it. A bf16 weight takes fp32 x (rounded to bf16 first with `round_x`); an int8 one
        quantizes each x row to int16 with one scale in the kernel (see cpu_ops.c)."""
        if proj.bits:
            return self.q_linear(x, proj, out)
        m, k = tensor("linear", "x", x, F32, (None, None))
        if not 1 <= m <= MAX_ROWS:
            raise bad("linear", f"the kernels' linear takes 1..{MAX_ROWS} rows, got {m}")
        n = check_proj("linear", "proj", proj, None, k)
        if out is None:
            y = torch.empty((m, n), dtype=torch.float32)
        else:
            y = out
            tensor("linear", "out", out, F32, (m, n))
        threads, acc = _threads(m * n * k), int(out is not None)
        w, bias = proj.weight.data_ptr(), _ptr(proj.bias)
        if proj.scale is not None:
            rc = self._int8_linear(
                w, proj.scale.data_ptr(), x.data_ptr(), bias, y.data_ptr(), m, n, k, threads, acc
            )
        else:
            mode = self._mode(proj.round_x)
            rc = self._linear(w, x.data_ptr(), bias, y.data_ptr(), m, n, k, threads, acc, mode)
        if rc:
            raise error("linear", rc)
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

    def q_linear(
        self,
        x: torch.Tensor,
        proj: ProjWeights,
        out: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """x [M, K] (any M, fp32 or bf16) @ `proj`.T (+ bias) -> [M, N] in `dtype` (fp32
        or bf16) for `proj` in blocks of 32 (`bits` 4 or 8, engine/block_quant.py); with
        `out` (fp32 or bf16), adds to it. Each x block is quantized to int8 in the kernel
        (see cpu_ops.c)."""
        m, k = tensor("q_linear", "x", x, F32_BF16, (None, None))
        if not proj.bits:
            raise bad("q_linear", "proj is not in blocks (bits 4 or 8)")
        n = check_proj("q_linear", "proj", proj, None, k)
        if out is None:
            y = torch.empty((m, n), dtype=dtype)
            tensor("q_linear", "dtype", y, F32_BF16, (m, n))
        else:
            y = out
            tensor("q_linear", "out", out, F32_BF16, (m, n))
        rc = self._q_linear(
            proj.weight.data_ptr(), proj.bits, x.data_ptr(), _ptr(proj.bias), y.data_ptr(),
            m, n, k, _threads(m * n * k), int(out is not None), int(self.vnni),
            int(x.dtype == torch.bfloat16), int(y.dtype == torch.bfloat16),
        )  # fmt: skip
        if rc:
            raise error("q_linear", rc)
        return y

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
        """The C description of `layers` (each with its KV cache [blocks, block_size, 2,
        kv_heads, head_dim], bf16 or fp32, all alike) and `rope` (fp32 pairs [positions,
        head_dim/2, 2]) for `decode_layers`; every weight's dtype and shape checked."""
        return build_plan(
            layers, {False: self._mode(False), True: self._mode(True)}, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, eps=eps, rope=rope,
            kv_caches=kv_caches, vnni=self.vnni,
        )  # fmt: skip

    def decode_layers(
        self,
        plan: DecodePlan,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        num_keys: torch.Tensor,
        lora: LoRARows | None = None,
    ) -> None:
        """Every layer of `plan` on fp32 h [M, H] (M <= MAX_ROWS decoding requests), in
        place: `DecoderLayer.forward_decode` layer after layer, bit for bit (with `lora`,
        each projection's adapter deltas as `lora_add` computes them; a plan of four
        projections a layer). `positions`, `slots`, `num_keys` [M] and the block `table`
        [M, nblk] are int64."""
        op, model = "decode_layers", plan.model
        m = tensor(op, "h", h, F32, (None, model.H))[0]
        if not 1 <= m <= MAX_ROWS:
            raise bad(op, f"takes 1..{MAX_ROWS} rows, got {m}")
        tensor(op, "positions", positions, I64, (m,))
        nblk = _step_ids(op, m, table, slots, num_keys)
        adapters = row_slots = None
        if lora is not None:
            if len(lora.plan.projs) != 4 * model.layers:
                raise bad(op, f"a LoRA plan of 4 projections a layer, got {len(lora.plan.projs)}")
            tensor(op, "row_slots", lora.row_slots, I64, (m,))
            adapters, row_slots = lora.plan.projs, lora.row_slots.data_ptr()
        model.threads = torch.get_num_threads()
        model.min_work = config.options().kernel_parallel_min_work
        rc = self._decode_layers(
            ctypes.byref(model), plan.layers, h.data_ptr(), m, positions.data_ptr(),
            slots.data_ptr(), table.data_ptr(), nblk, num_keys.data_ptr(), adapters, row_slots,
        )  # fmt: skip
        if rc:
            raise error(op, rc)

    def lora_plan(
        self, projs: Sequence[LoRAProj | None], slots: int, wide: bool | None = None
    ) -> LoRAPlan:
        """The C description of `projs` (None: no adapter has that projection) for
        `lora_add` and `decode_layers`; `wide`: the AVX-512F form (default: on a CPU with
        AVX512-BF16, which has it), else AVX2. A wide plan on a CPU with AVX512-BF16 takes
        a bf16 x in the `vdpbf16ps` form where a projection has its bf16 copies."""
        wide = self.bf16_dot if wide is None else wide
        return build_lora_plan(projs, slots, wide, wide and self.bf16_dot)

    def lora_add(
        self,
        plan: LoRAPlan,
        index: int,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: torch.Tensor,
        serial: bool = False,
    ) -> None:
        """y [M, N] += the delta of projection `index` of `plan` at x [M, K] for each row's
        slot (`rows`: int64 [M], -1 the base model: nothing added). x and y fp32 or bf16;
        the low-rank products in fp32 (a bf16 x in the `vdpbf16ps` form where the plan has
        bf16 copies: bf16 A, B and xa, fp32 sums), a bf16 y rounded once after the add.
        `serial`: on this thread alone."""
        op, proj = "lora_add", plan.projs[index]
        m = tensor(op, "x", x, F32_BF16, (None, proj.K))[0]
        tensor(op, "y", y, F32_BF16, (m, proj.N))
        tensor(op, "rows", rows, I64, (m,))
        if m == 0:
            return
        x_bf16, y_bf16 = int(x.dtype == torch.bfloat16), int(y.dtype == torch.bfloat16)
        threads = 1 if serial else _threads(m * proj.parts * proj.rank * (proj.K + proj.N))
        rc = self._lora_add(
            ctypes.byref(proj), x.data_ptr(), x_bf16, y.data_ptr(), y_bf16, m, rows.data_ptr(),
            threads,
        )  # fmt: skip
        if rc:
            raise error(op, rc)

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """fp32 h [M, H] -> RMSNorm(h) * weight (fp32 [H])."""
        m, n = tensor("rms_norm", "h", h, F32, (None, None))
        tensor("rms_norm", "weight", weight, F32, (n,))
        out = torch.empty_like(h)
        self._rms_norm(h.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), m, n)
        return out

    def rope_(self, x: torch.Tensor, heads: int, table: torch.Tensor, pos: torch.Tensor) -> None:
        """Rotate the first `heads` heads of each row of `x` [M, >= heads*D] (rows contiguous,
        (re, im) pairs) by `table` [positions, D/2, 2] at int64 `pos` [M], in place."""
        m, npos, half = self._rope_args("rope_", F32, x, heads, table, pos)
        rc = self._rope(x.data_ptr(), x.stride(0), m, table.data_ptr(), pos.data_ptr(), npos,
                        heads, half)  # fmt: skip
        if rc:
            raise error("rope_", rc)

    @staticmethod
    def _rope_args(
        op: str, dtypes: tuple[torch.dtype, ...], x: torch.Tensor, heads: int,
        table: torch.Tensor, pos: torch.Tensor,
    ) -> tuple[int, int, int]:  # fmt: skip
        """rows, positions and D/2 of a RoPE call, its tensors checked."""
        npos, half, _ = tensor(op, "table", table, F32, (None, None, 2))
        m, width = tensor(op, "x", x, dtypes, (None, None), rows=True)
        if not 0 <= heads * 2 * half <= width:
            raise bad(op, f"{heads} heads of {2 * half} in rows of {width}")
        tensor(op, "pos", pos, I64, (m,))
        return m, npos, half

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """fp32 gu [M, 2I] -> SiLU(gu[:, :I]) * gu[:, I:]."""
        m, two_i = tensor("silu_mul", "gu", gu, F32, (None, None))
        if two_i % 2:
            raise bad("silu_mul", f"gu's width {two_i} is odd")
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
        """Rows of `qkv` [P, (Hq + 2*Hkv)*D] (rows contiguous) are q | K | V of one decoding
        request each: write K|V into `slots` [P] int64, then attend q over each request's
        keys (block `table` [P, nblk] int64, `num_keys` [P] int64) -> [P, Hq*D]. The cache
        [blocks, bs, 2, Hkv, D] is fp32 or bf16."""
        op = "attn_decode"
        nb, bs, _, hkv, d = tensor(op, "kv_cache", kv_cache, F32_BF16, (None, None, 2, None, None))
        if not (num_heads > 0 and hkv > 0 and num_heads % hkv == 0):
            raise bad(op, f"{num_heads} heads over {hkv} KV heads")
        p = tensor(op, "qkv", qkv, F32, (None, (num_heads + 2 * hkv) * d), rows=True)[0]
        nblk = _step_ids(op, p, table, slots, num_keys)
        out = torch.empty((p, num_heads * d), dtype=torch.float32)
        rc = self._attn(
            qkv.data_ptr(), qkv.stride(0), kv_cache.data_ptr(), nb, slots.data_ptr(),
            table.data_ptr(), nblk, num_keys.data_ptr(), window or 0,
            p, num_heads, hkv, d, bs, d**-0.5, out.data_ptr(),
            # shared whenever there are tasks to share: the helpers still spin from the
            # qkv GEMV (as in sluice_decode_layers)
            torch.get_num_threads() if p * hkv > 1 else 1,
            int(kv_cache.dtype == torch.bfloat16),
        )  # fmt: skip
        if rc:
            raise error(op, rc)
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
        `bf16_dot` (AVX512-BF16), D a multiple of 32 up to 256, Hq / Hkv <= 16."""
        op = "attn_paged"
        self._need_bf16_dot(op)
        nb, bs, _, hkv, d = tensor(op, "kv_cache", kv_cache, BF16, (None, None, 2, None, None))
        p, hq, _ = tensor(op, "q", q, F32_BF16, (None, None, d), rows=True)
        if not (hkv > 0 and hq % hkv == 0 and hq // hkv <= 16 and d % 32 == 0 and d <= 256):
            raise bad(
                op, f"Hq {hq} a multiple of Hkv {hkv} up to 16x, D {d} a multiple of 32 <= 256"
            )
        r, nblk = tensor(op, "table", table, I64, (None, None))
        tensor(op, "num_keys", num_keys, I64, (p,))
        if requests is not None:
            tensor(op, "requests", requests, I64, (p,))
        out = torch.empty((p, hq, d), dtype=q.dtype)
        rc = self._paged(
            q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), out.data_ptr(),
            kv_cache.data_ptr(), nb, table.data_ptr(), r, nblk, _ptr(requests),
            num_keys.data_ptr(), window or 0, p, hq, hkv, d, bs, d**-0.5,
            _threads(p * hq * d * nblk * bs * 2),
        )  # fmt: skip
        if rc:
            raise error(op, rc)
        return out

    def _need_bf16_dot(self, op: str) -> None:
        if not self.bf16_dot:
            raise RuntimeError(f"{op} needs AVX512-BF16, which this CPU lacks")

    # The bf16 small ops (need `bf16_dot`; widths multiples of 16): one pass each where
    # torch takes several ops, with torch's roundings (see cpu_ops.c).

    def rms_norm_bf16(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """fp32 h [M, H] -> bf16 RMSNorm(h) * weight (fp32 weight [H])."""
        op = "rms_norm_bf16"
        self._need_bf16_dot(op)
        m, n = tensor(op, "h", h, F32, (None, None))
        if n % 16:
            raise bad(op, f"width {n} is not a multiple of 16")
        tensor(op, "weight", weight, F32, (n,))
        out = torch.empty((m, n), dtype=torch.bfloat16)
        self._rms_norm_bf16(
            h.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), m, n, _small_op_threads(m * n)
        )
        return out

    def silu_mul_bf16(self, gu: torch.Tensor) -> torch.Tensor:
        """bf16 gu [M, 2I] -> bf16 SiLU(gu[:, :I]) * gu[:, I:]."""
        op = "silu_mul_bf16"
        self._need_bf16_dot(op)
        m, two_i = tensor(op, "gu", gu, BF16, (None, None))
        if two_i % 32:
            raise bad(op, f"width {two_i} is not twice a multiple of 16")
        out = torch.empty((m, two_i // 2), dtype=torch.bfloat16)
        self._silu_mul_bf16(
            gu.data_ptr(), out.data_ptr(), m, two_i // 2, _small_op_threads(m * two_i)
        )
        return out

    def add_bf16_(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """fp32 h [M, H] += bf16 y [M, H] (both contiguous), in place: `h.add_(y)`."""
        op = "add_bf16_"
        self._need_bf16_dot(op)
        m, n = tensor(op, "h", h, F32, (None, None))
        if n % 16:
            raise bad(op, f"width {n} is not a multiple of 16")
        tensor(op, "y", y, BF16, (m, n))
        self._add_bf16(h.data_ptr(), y.data_ptr(), m, n, _small_op_threads(m * n))
        return h

    def argmax_bf16(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [M]: each bf16 row's first maximum (or first NaN), as numpy's argmax of
        the row in fp32 (`engine.sampler.greedy_tokens`), without the fp32 copy."""
        op = "argmax_bf16"
        self._need_bf16_dot(op)
        logits = logits.contiguous()
        m, n = tensor(op, "logits", logits, BF16, (None, None))
        out = torch.empty(m, dtype=torch.int64)
        self._argmax_bf16(logits.data_ptr(), m, n, out.data_ptr(), _small_op_threads(m * n))
        return out

    def rope_bf16_(
        self, x: torch.Tensor, heads: int, table: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """`rope_` for bf16 rows of `x` (heads' last dim contiguous), D/2 a multiple of 8,
        in place."""
        op = "rope_bf16_"
        self._need_bf16_dot(op)
        m, npos, half = self._rope_args(op, BF16, x, heads, table, pos)
        if half % 8:
            raise bad(op, f"head_dim {2 * half} is not a multiple of 16")
        rc = self._rope_bf16(
            x.data_ptr(),
            x.stride(0),
            m,
            table.data_ptr(),
            pos.data_ptr(),
            npos,
            heads,
            half,
            _small_op_threads(m * heads * half * 2),
        )
        if rc:
            raise error(op, rc)
