"""The AVX2 bf16 GEMV kernel and the fp32 compute path for bf16 models on CPUs without bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine import kernels
from engine.config import EngineConfig
from engine.loader import load_model
from engine.models.cpu_linear import PackedLinear, can_pack, native_low_precision
from engine.runner.model_runner import ModelRunner, compute_dtype
from tests.unit.engine.runner_driver import run_greedy

needs_kernel = pytest.mark.skipif(
    kernels.bf16_linear() is None, reason="no AVX2/FMA or no C compiler"
)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(512, 768), (1000, 37), (48, 5), (1408, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_matches_fp32_linear(rows: int, k: int, n: int, with_bias: bool) -> None:
    """Exact bf16 -> fp32 widening, fp32 accumulation: equal to F.linear on the widened
    weights up to summation order (fast path: K % 16 == 0 and one row; generic otherwise)."""
    fn = kernels.bf16_linear()
    assert fn is not None
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    ref = torch.nn.functional.linear(x, w.float(), bias)
    out = fn(x, w, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_bf16_kernel_rejects_more_rows_than_it_serves() -> None:
    fn = kernels.bf16_linear()
    assert fn is not None
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        fn(torch.zeros(kernels.MAX_ROWS + 1, 16), w, None)


def test_compute_dtype_is_fp32_only_where_bf16_is_emulated() -> None:
    cpu = torch.device("cpu")
    assert compute_dtype(torch.float32, cpu) == torch.float32
    expected = torch.bfloat16 if native_low_precision(torch.bfloat16) else torch.float32
    assert compute_dtype(torch.bfloat16, cpu) == expected


@needs_kernel
@pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN prepack unavailable")
def test_packed_linear_small_batches_take_the_bf16_copy_with_the_same_result() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(512, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())  # a bf16 checkpoint, upcast
    packed = PackedLinear(lin, small_dtype=torch.bfloat16)
    assert packed.small_weight is not None and packed.small_weight.dtype == torch.bfloat16
    x = torch.randn(8, 512)
    with torch.inference_mode():
        many = packed(x)  # 8 rows: the fp32 prepacked weights
        few = packed(x[:3])  # 3 rows: the bf16 kernel
    torch.testing.assert_close(few, many[:3], rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(native_low_precision(torch.bfloat16), reason="this CPU has native bf16")
def test_bf16_model_on_an_avx2_cpu_computes_in_fp32_with_the_same_tokens(tmp_path: Path) -> None:
    """The upcast keeps the checkpoint's bf16 values: greedy tokens equal an fp32 run of
    the same bf16-rounded weights."""
    torch.set_num_threads(2)
    bf16 = load_model("tiny-llama", data_dir=tmp_path, dtype="bfloat16")
    ref = load_model("tiny-llama", data_dir=tmp_path, dtype="bfloat16")
    ref.model.set_dtype(torch.float32)  # same values, fp32 storage and compute
    prompt = bf16.tokenizer.encode("The sluice gate opens and the water")
    cfg = EngineConfig(num_kv_blocks=16, block_size=16, dtype="bfloat16")
    runner = ModelRunner(bf16.model, cfg)
    assert runner.dtype == torch.float32 and runner.kv_caches[0].dtype == torch.float32
    ref_runner = ModelRunner(ref.model, EngineConfig(num_kv_blocks=16, block_size=16))
    assert run_greedy(runner, [prompt], 12) == run_greedy(ref_runner, [prompt], 12)
