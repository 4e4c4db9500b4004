"""CPU fast path for projections: oneDNN-prepacked weights (what inductor's freezing does).

Applied by `engine.runner.model_runner.ModelRunner` to a model on CPU. On a CPU with
native bf16, prepacked GEMVs run several times faster than `F.linear` with bit-identical
results in bf16; fp32 gains too, with ~1e-5 relative differences (a different reduction
order). Falls back to the plain linear when oneDNN is unavailable.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine import kernels
from sluice.engine.models.hugepages import huge_pages_for_new_memory

logger = logging.getLogger(__name__)


def row_bucket(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per doubling (exact up to 16): at most 12.5 %
    padding, and 72 distinct sizes up to 2,048 rows.

    oneDNN builds a primitive for every new input shape, which costs more than the matmul
    for a small model. A step's row count is the tokens it schedules, different almost
    every time under load, so unbucketed steps would keep paying it (its cache also holds
    only 1,024 primitives).
    """
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


@dataclass(frozen=True, slots=True)
class RowPlan:
    """The row buckets (see `row_bucket`) of one projection shape that `F.linear` serves:
    measured faster than the prepacked call on this CPU (`tune_row_buckets`). The others
    go through oneDNN's prepacked weight."""

    plain: frozenset[int] = frozenset()


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight reordered once into oneDNN's blocked layout.

    Which is faster depends on the CPU and the shape: on an AVX2-only CPU `F.linear` can
    win small fp32 projections at few rows. So the plain weight is kept for the row buckets
    where `tune_row_buckets` measured `F.linear` faster (`plan`), and dropped when there
    are none.

    With `small_dtype` bf16 (a bf16 checkpoint) it also keeps the weight in bf16 for fp32
    inputs of at most `kernels.MAX_ROWS` rows (the fused decode path), which the bf16
    GEMV kernel serves at memory speed:
    - computed in fp32 on a CPU without native bf16 (the weight here is the fp32 upcast):
      batch-1 decode streams half the bytes of fp32 (about half the time); the bf16 copy
      costs 50 % more weight memory;
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
        self.weight: torch.Tensor | None = w  # plain, until `use` drops it
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.plan = RowPlan()
        self.ops = kernels.cpu_ops() if small_dtype == torch.bfloat16 else None
        self.small_weight: torch.Tensor | None = None
        self.small_bias: torch.Tensor | None = None
        self.round_x = w.dtype == torch.bfloat16  # computing in bf16: matmul inputs are bf16
        if self.ops is not None and w.dtype in (torch.float32, torch.bfloat16):
            self.small_weight = w.to(torch.bfloat16).contiguous()  # exact: bf16-valued fp32
            self.small_bias = None if self.bias is None else self.bias.float()

    def kernel_weights(self) -> kernels.ProjWeights | None:
        """The bf16 copy as `CpuOps.decode_layers` takes it, if there is one."""
        if self.small_weight is None:
            return None
        return kernels.ProjWeights(self.small_weight, self.small_bias, round_x=self.round_x)

    def use(self, plan: RowPlan) -> None:
        """Serve the buckets in `plan.plain` with `F.linear`; without any, drop the plain
        weight (it would only cost memory)."""
        self.plan = plan
        if not plan.plain:
            self.weight = None

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
        if self.weight is not None and bucket in self.plan.plain:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self._packed(x, rows, bucket)
        return y if out is None else out.add_(y)

    def _packed(self, x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor:
        if bucket != rows:
            x = torch.cat((x, x.new_zeros((bucket - rows, x.shape[1]))))
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return y[:rows] if bucket != rows else y

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> None:
        """h += forward(x)."""
        self.forward(x, out=h)


TUNE_MAX_ROWS = 256  # past this the two were even here; larger buckets are only warmed
TUNE_ROUNDS = 5  # alternating calls of each per bucket; the fastest of each is compared


def tune_row_buckets(linear: PackedLinear, max_rows: int, deadline: float) -> tuple[RowPlan, int]:
    """Build `linear`'s oneDNN primitive for every row bucket up to `max_rows`, smallest
    first, until `deadline` (`time.perf_counter()`), so serving does not build them (see
    `row_bucket`); up to `TUNE_MAX_ROWS`, also time the prepacked call against `F.linear`
    and plan `F.linear` where it was faster. Returns the plan and the buckets warmed.
    Without the plain weight (already planned) it only warms. Rows the bf16 kernel serves
    (`small_weight`, up to `kernels.MAX_ROWS`) are skipped."""
    first = kernels.MAX_ROWS + 1 if linear.small_weight is not None else 1
    buckets = sorted({row_bucket(m) for m in range(first, max_rows + 1)})
    plain: set[int] = set()
    weight, bias = linear.weight, linear.bias
    warmed = 0
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in buckets:
            if time.perf_counter() > deadline:
                break
            x = torch.randn((rows, linear.in_features), generator=generator)
            x = x.to(linear.packed.dtype)
            linear._packed(x, rows, rows)  # builds the primitive
            warmed += 1
            if weight is None or rows > TUNE_MAX_ROWS:
                continue
            best_packed = best_plain = math.inf
            for _ in range(TUNE_ROUNDS):
                start = time.perf_counter()
                linear._packed(x, rows, rows)
                middle = time.perf_counter()
                F.linear(x, weight, bias)
                best_packed = min(best_packed, middle - start)
                best_plain = min(best_plain, time.perf_counter() - middle)
            if best_plain < best_packed:
                plain.add(rows)
    return RowPlan(frozenset(plain)), warmed


def native_low_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` in hardware (AVX-512 BF16/FP16, AMX, AVX-NE-CONVERT).

    Without it (an AVX2-only CPU) torch emulates bf16/fp16 matmuls by converting to fp32
    inside the kernel: a bf16 prefill then takes several times as long as fp32.
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
    max_rows: int = 0,
    budget_s: float = 0.0,
) -> int:
    """Swap `nn.Linear` children called `names` (any depth) for PackedLinear; return count.

    `small_dtype`: the checkpoint's dtype when the model was upcast to fp32 for compute
    (see PackedLinear). `max_rows`, `budget_s`: the first projection of each shape is
    tuned (`tune_row_buckets`) up to `max_rows` rows within its share of `budget_s`, and
    the others of its shape use its plan; each keeps its plain weight only where the plan
    uses it, so the model never holds two copies of weights the plan does not need."""
    if not can_pack(dtype):
        return 0
    children = [
        (module, name, child)
        for module in list(model.modules())
        for name in names
        if type(child := getattr(module, name, None)) is nn.Linear
    ]
    # projections of one shape share oneDNN primitives and a plan
    keys = [(c.in_features, c.out_features, c.weight.dtype, c.bias is None) for *_, c in children]
    share_s = budget_s / max(1, len(set(keys)))
    plans: dict[tuple[int, int, torch.dtype, bool], RowPlan] = {}
    count = warmed = 0
    with torch.inference_mode(False), torch.no_grad(), huge_pages_for_new_memory():
        for (module, name, child), key in zip(children, keys, strict=True):
            try:
                packed = PackedLinear(child, small_dtype=small_dtype)
            except RuntimeError as e:  # unsupported shape/dtype on this build
                logger.warning("oneDNN prepack failed for %s: %s", name, e)
                return count
            plan = plans.get(key)
            if plan is None:
                deadline = time.perf_counter() + share_s
                plan, n = tune_row_buckets(packed, max_rows, deadline)
                plans[key] = plan
                warmed += n
            packed.use(plan)
            setattr(module, name, packed)
            count += 1
    for key, plan in plans.items():
        logger.debug("projection %s: F.linear for row buckets %s", key, sorted(plan.plain))
    logger.debug("warmed %s oneDNN (shape, row bucket) pairs", warmed)
    return count
