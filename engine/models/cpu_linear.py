"""CPU fast path for projections: oneDNN-prepacked weights (what inductor's freezing does).

Applied by `engine.runner.model_runner.ModelRunner` to a model on CPU. Measured on the
2-core AVX-512/AMX dev CPU (torch 2.13, 2 threads): a bf16 512x32000 GEMV takes ~0.6-0.9 ms
prepacked vs ~2.2-2.5 ms through `F.linear` (bit-identical results), 512x2816 0.05 vs 0.13
ms; batch-64 matmuls gain 10-30 %. fp32 gains 1.3-3x with ~1e-5 relative differences (a
different reduction order). Falls back to the plain linear when oneDNN is unavailable.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine import kernels
from engine.models.hugepages import huge_pages_for_new_memory

logger = logging.getLogger(__name__)


def row_bucket(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per doubling (exact up to 16): at most 12.5 %
    padding, and 72 distinct sizes up to 2,048 rows.

    oneDNN builds a primitive for every new input shape, which costs more than the matmul
    for a small model: a 100-token prefill step of tiny-llama took 3.6 ms the first time
    its row count was seen and 1.9 ms after (one thread, 2-core AVX-512 EPYC). A step's
    row count is the tokens it schedules, different almost every time under load, so
    unbucketed steps kept paying it (its cache also holds only 1,024 primitives).
    """
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight reordered once into oneDNN's blocked layout.

    With `small_dtype` bf16 (a bf16 checkpoint) it also keeps the weight in bf16 for fp32
    inputs of at most `kernels.MAX_ROWS` rows (the fused decode path), which the bf16
    GEMV kernel serves at memory speed:
    - computed in fp32 on a CPU without native bf16 (the weight here is the fp32 upcast):
      batch-1 decode streams half the bytes of fp32 (measured on the AVX2 EPYC, 512x2816:
      0.08-0.10 ms vs 0.16-0.18 ms fp32 prepacked; 512x32000: 2.0-2.5 vs 3.5 ms); the
      bf16 copy costs 50 % more weight memory;
    - computed in bf16 (native): x is rounded to bf16 as the bf16 path rounds it, and the
      checkpoint's bf16 tensor is kept beside the packed one (twice the weight memory);
      the kernel's fp32 output spares the casts and small ops around oneDNN's bf16 GEMV.
    """

    def __init__(
        self, linear: nn.Linear, batch_hint: int = 1, small_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.ops = kernels.cpu_ops() if small_dtype == torch.bfloat16 else None
        self.small_weight: torch.Tensor | None = None
        self.small_bias: torch.Tensor | None = None
        self.round_x = w.dtype == torch.bfloat16  # computing in bf16: matmul inputs are bf16
        if self.ops is not None and w.dtype in (torch.float32, torch.bfloat16):
            self.small_weight = w.to(torch.bfloat16).contiguous()  # exact: bf16-valued fp32
            self.small_bias = None if self.bias is None else self.bias.float()

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias); with `out`, added into it (one kernel call on the bf16 path).
        An fp32 x of a bf16-computing layer gets an fp32 result (the fused decode path)."""
        if (
            self.small_weight is not None
            and x.shape[0] <= kernels.MAX_ROWS
            and x.dtype == torch.float32
        ):
            assert self.ops is not None
            return self.ops.bf16_linear(
                x.contiguous(), self.small_weight, self.small_bias, out=out, round_x=self.round_x
            )
        rows = x.shape[0]
        bucket = row_bucket(rows) if x.dim() == 2 else rows
        if bucket != rows:
            x = torch.cat((x, x.new_zeros((bucket - rows, x.shape[1]))))
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        if bucket != rows:
            y = y[:rows]
        return y if out is None else out.add_(y)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> None:
        """h += forward(x)."""
        self.forward(x, out=h)


def warm_row_buckets(model: nn.Module, max_rows: int, budget_s: float) -> int:
    """Run each distinct PackedLinear shape once per row bucket up to `max_rows`, smallest
    first, until `budget_s` has passed, so serving does not build oneDNN primitives
    (see `row_bucket`); returns the number of (shape, bucket) pairs warmed. Layers of one
    shape share their primitives, so one of each shape is enough."""
    seen: dict[tuple[int, int, torch.dtype, bool], PackedLinear] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            key = (
                module.in_features,
                module.out_features,
                module.packed.dtype,
                module.bias is None,
            )
            seen.setdefault(key, module)
    buckets = sorted({row_bucket(m) for m in range(kernels.MAX_ROWS + 1, max_rows + 1)})
    deadline = time.perf_counter() + budget_s
    warmed = 0
    with torch.inference_mode():
        for rows in buckets:
            for linear in seen.values():
                if time.perf_counter() > deadline:
                    return warmed
                linear(torch.zeros((rows, linear.in_features), dtype=linear.packed.dtype))
                warmed += 1
    return warmed


def native_low_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` in hardware (AVX-512 BF16/FP16, AMX, AVX-NE-CONVERT).

    Without it (an AVX2-only CPU) torch emulates bf16/fp16 matmuls by converting to fp32
    inside the kernel. Measured on a 2-core AVX2 AMD EPYC (torch 2.13): 64x512x2816 took
    10-12 ms in bf16 vs 1.6 ms fp32 prepacked, and a 64-token prefill of the bench model
    ~6x longer; the bf16 batch-1 GEMVs were about even with fp32.
    """
    if dtype == torch.float32:
        return True
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16 and hasattr(mkldnn, "_is_mkldnn_bf16_supported"):
        return bool(mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16 and hasattr(mkldnn, "_is_mkldnn_fp16_supported"):
        return bool(mkldnn._is_mkldnn_fp16_supported())
    return False


def can_pack(dtype: torch.dtype) -> bool:
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and dtype in (torch.bfloat16, torch.float32)
        and native_low_precision(dtype)  # oneDNN's bf16 reorder needs AVX-512 or AVX-NE
    )


def pack_linears(
    model: nn.Module,
    names: tuple[str, ...],
    dtype: torch.dtype,
    small_dtype: torch.dtype | None = None,
) -> int:
    """Swap `nn.Linear` children called `names` (any depth) for PackedLinear; return count.

    `small_dtype`: the checkpoint's dtype when the model was upcast to fp32 for compute
    (see PackedLinear)."""
    if not can_pack(dtype):
        return 0
    count = 0
    with torch.inference_mode(False), torch.no_grad(), huge_pages_for_new_memory():
        for module in list(model.modules()):
            for name in names:
                child = getattr(module, name, None)
                if type(child) is nn.Linear:
                    try:
                        setattr(module, name, PackedLinear(child, small_dtype=small_dtype))
                        count += 1
                    except RuntimeError as e:  # unsupported shape/dtype on this build
                        logger.warning("oneDNN prepack failed for %s: %s", name, e)
                        return count
    return count
