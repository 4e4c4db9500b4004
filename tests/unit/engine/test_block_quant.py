"""GGUF projections kept in quantized blocks (engine/block_quant.py, `CpuOps.q_linear`):
each GGUF type repacks to weights equal to `gguf.quants.dequantize`'s; the kernel (VNNI
where the CPU has it, and the AVX2 path always) equals a numpy reference of its int8
activations at odd shapes and any row count, and stays within the activations' rounding
of the de-quantized matmul; the torch fallback equals the de-quantized matmul; a quantized
GGUF loads with its blocks kept unless in float32, and decodes in the fused plan close to
the de-quantized model."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from sluice.engine import kernels
from sluice.engine.block_quant import BlockQuantLinear, repack
from sluice.engine.block_quant import dequantize as dequantize_blocks
from sluice.engine.config import EngineConfig
from sluice.engine.loader import load_model
from sluice.engine.runner.model_runner import ModelRunner
from tests.unit.engine.gguf_writer import write_gguf
from tests.unit.engine.runner_driver import run_greedy, save_hf_model
from tests.unit.engine.test_gguf_file import _random_k_blocks
from tests.unit.engine.test_model_hf_equivalence import _hf_model, _prompts

needs_kernel = pytest.mark.skipif(kernels.cpu_ops() is None, reason="no AVX2/FMA or no C compiler")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q8_0: 8}


def _raw(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """A GGUF tensor's blocks of `qtype` (n x k weights): quantized random weights, or
    random K blocks (the gguf package cannot quantize to K types)."""
    rng = np.random.default_rng(seed)
    if qtype == Q.Q4_K:
        return _random_k_blocks(n, k, qtype, rng)
    return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T with x quantized as the kernel does: per 32 inputs, q = round(x * 127 /
    absmax) (ties to even, fp32), scale absmax / 127."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv)
    xq = (q * (amax / np.float32(127))).reshape(x.shape)
    return xq.astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize(("qtype", "k"), [(Q.Q4_0, 96), (Q.Q4_1, 96), (Q.Q8_0, 96), (Q.Q4_K, 512)])
def test_repacked_blocks_hold_the_weights_gguf_dequantizes(qtype: Q, k: int) -> None:
    raw = _raw(qtype, 37, k, 0)
    packed = torch.from_numpy(repack(raw, qtype, 37, k))
    want = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(dequantize_blocks(packed, BITS[qtype], k), want)


def _vnni_modes() -> list[bool]:
    ops = kernels.cpu_ops()
    return [False, True] if ops is not None and ops.vnni else [False]


@needs_kernel
@pytest.mark.parametrize(
    ("qtype", "n", "k"),
    [(Q.Q4_0, 37, 96), (Q.Q4_1, 37, 96), (Q.Q4_1, 5, 32), (Q.Q8_0, 33, 160), (Q.Q4_K, 19, 512)],
)
@pytest.mark.parametrize("rows", [1, 3, 64, 65])
@pytest.mark.parametrize("vnni", _vnni_modes())
def test_kernel_equals_the_reference_of_its_int8_activations(
    qtype: Q, n: int, k: int, rows: int, vnni: bool
) -> None:
    """Bias, accumulation into `out` and the result within the activations' rounding of
    the de-quantized matmul; odd N, K not a multiple of 256, row counts past a tile of 4."""
    ops = copy.copy(kernels.cpu_ops())
    assert ops is not None
    ops.vnni = vnni
    raw = _raw(qtype, n, k, rows + n)
    w = dequantize(raw, qtype).astype(np.float32)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    x[0, :32] = 0.0  # a zero block: scale 0
    proj = kernels.ProjWeights(
        torch.from_numpy(repack(raw, qtype, n, k)), bias, bits=BITS[qtype], k=k
    )
    want = torch.from_numpy(_reference(x.numpy(), w)).float() + bias
    got = ops.q_linear(x, proj)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    acc = torch.randn(rows, n, generator=g)
    torch.testing.assert_close(ops.q_linear(x, proj, out=acc.clone()), acc + want,
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    exact = x.double() @ torch.from_numpy(w).double().T + bias.double()
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 2e-2


@needs_kernel
def test_kernel_refuses_what_it_would_read_past() -> None:
    ops = kernels.cpu_ops()
    assert ops is not None
    raw = _raw(Q.Q4_1, 8, 64, 0)
    proj = kernels.ProjWeights(torch.from_numpy(repack(raw, Q.Q4_1, 8, 64)), None, bits=4, k=64)
    with pytest.raises(ValueError, match="expected 96"):
        ops.q_linear(torch.randn(2, 96), proj)
    short = kernels.ProjWeights(proj.weight[:, :-1], None, bits=4, k=64)
    with pytest.raises(ValueError, match=r"proj\.weight"):
        ops.q_linear(torch.randn(2, 64), short)
    odd = kernels.ProjWeights(proj.weight, None, bits=4, k=48)
    with pytest.raises(ValueError, match="48"):
        ops.q_linear(torch.randn(2, 48), odd)
    with pytest.raises(ValueError, match="out"):
        ops.q_linear(torch.randn(2, 64), proj, out=torch.zeros(2, 7))


def test_without_kernels_the_module_de_quantizes_for_each_call() -> None:
    """The torch fallback (kernels off, or a CPU without AVX2): the de-quantized matmul,
    in the input's dtype."""
    raw = _raw(Q.Q4_1, 24, 64, 1)
    lin = BlockQuantLinear(torch.from_numpy(repack(raw, Q.Q4_1, 24, 64)), 4, 64, None)
    x = torch.randn(5, 64)
    w = torch.from_numpy(dequantize(raw, Q.Q4_1).astype(np.float32))
    torch.testing.assert_close(lin(x), x @ w.T)
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(2)
    tmp = tmp_path_factory.mktemp("q4")
    hf_dir = save_hf_model(_hf_model("llama3-rope-tied"), tmp / "hf")
    return write_gguf(hf_dir, tmp / "q4_1.gguf", "llama", Q.Q4_1)


def _greedy(
    path: Path, dtype: str, quantization: str | None
) -> tuple[list[list[int]], ModelRunner]:
    lm = load_model(path, dtype=dtype, quantization=quantization)
    runner = ModelRunner(lm.model, EngineConfig(num_kv_blocks=32, block_size=4, dtype=dtype))
    return run_greedy(runner, _prompts(), 12), runner


def test_a_quantized_gguf_keeps_its_blocks_when_asked(q4_gguf: Path) -> None:
    packed = load_model(q4_gguf, dtype="bfloat16", quantization="gguf").model
    assert isinstance(packed.layers[0].qkv_proj, BlockQuantLinear)
    assert isinstance(packed.lm_head, BlockQuantLinear)  # tied: the embedding's blocks
    for quantization in (None, "none"):
        plain = load_model(q4_gguf, dtype="bfloat16", quantization=quantization).model
        assert not isinstance(plain.layers[0].qkv_proj, BlockQuantLinear)


@needs_kernel
def test_blocks_decode_in_the_fused_plan_close_to_the_de_quantized_model(q4_gguf: Path) -> None:
    """fp32 compute both sides: only the kernel's int8 activations differ, so every
    prompt's first token and most whole sequences agree (a random model has near ties
    that the rounding may tip; a wrong block layout, q/k order or min term would scramble
    them all)."""
    got, runner = _greedy(q4_gguf, "float32", "gguf")
    assert runner.decode_plan is not None
    want, _ = _greedy(q4_gguf, "float32", None)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 2


@needs_kernel
@pytest.mark.parametrize("rows", [1, 64])
def test_kernel_reads_and_writes_bf16(rows: int) -> None:
    """A model computing in bf16: bf16 x (widened exactly), a bf16 result rounded once
    after the bias and any accumulation into `out`."""
    ops = kernels.cpu_ops()
    assert ops is not None
    raw = _raw(Q.Q4_1, 40, 128, 3)
    w = dequantize(raw, Q.Q4_1).astype(np.float32)
    proj = kernels.ProjWeights(torch.from_numpy(repack(raw, Q.Q4_1, 40, 128)), None, bits=4, k=128)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    want = torch.from_numpy(_reference(x.float().numpy(), w)).float()
    got = ops.q_linear(x, proj, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16)) or torch.allclose(
        got.float(), want, rtol=8e-3, atol=1e-3
    )
    acc = torch.randn(rows, 40).to(torch.bfloat16)
    summed = ops.q_linear(x, proj, out=acc.clone())
    torch.testing.assert_close(summed.float(), (acc.float() + want), rtol=8e-3, atol=2e-2)


@needs_kernel
def test_a_cpu_without_vnni_gets_the_avx2_path_with_the_same_sums(tmp_path: Path) -> None:
    """The instruction choice follows /proc/cpuinfo: an AVX2-only CPU loads the library
    with VNNI off, and its q_linear gives what the reference of its activations gives."""
    ops = kernels.load_cpu_ops(tmp_path, cpuinfo="processor\t: 0\nflags\t\t: avx avx2 fma\n")
    assert ops is not None and not ops.vnni and not ops.bf16_dot
    raw = _raw(Q.Q4_0, 9, 64, 5)
    proj = kernels.ProjWeights(torch.from_numpy(repack(raw, Q.Q4_0, 9, 64)), None, bits=4, k=64)
    x = torch.randn(2, 64)
    want = _reference(x.numpy(), dequantize(raw, Q.Q4_0).astype(np.float32))
    torch.testing.assert_close(ops.q_linear(x, proj), torch.from_numpy(want).float(),
                               rtol=1e-5, atol=1e-4)  # fmt: skip
