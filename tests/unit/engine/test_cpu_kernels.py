"""The CPU decode kernels (bf16 GEMV, fused small ops, paged decode attention, the work
sharing under them) and the fp32 compute path for bf16 models on CPUs without bf16."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from sluice.engine import kernels
from sluice.engine.config import EngineConfig
from sluice.engine.loader import load_model
from sluice.engine.models.cpu_linear import PackedLinear, can_pack, native_low_precision
from sluice.engine.runner.model_runner import ModelRunner, compute_dtype
from tests.unit.engine.runner_driver import run_greedy

needs_kernel = pytest.mark.skipif(kernels.cpu_ops() is None, reason="no AVX2/FMA or no C compiler")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(512, 768), (1000, 37), (48, 5), (1408, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_matches_fp32_linear(rows: int, k: int, n: int, with_bias: bool) -> None:
    """Exact bf16 -> fp32 widening, fp32 accumulation: equal to F.linear on the widened
    weights up to summation order (fast path: K % 16 == 0 and one row; generic otherwise)."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    ref = torch.nn.functional.linear(x, w.float(), bias)
    out = ops.bf16_linear(x, w, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    acc = torch.randn(rows, n, generator=g)
    torch.testing.assert_close(ops.bf16_linear(x, w, bias, out=acc.clone()), acc + ref,
                               rtol=1e-5, atol=1e-4)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("hardware_dot", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(512, 768), (1000, 37), (48, 5), (1408, 33)])
def test_bf16_kernel_rounding_x_matches_a_bf16_matmul(
    hardware_dot: bool, rows: int, k: int, n: int
) -> None:
    """round_x (a model computing in bf16): x rounded to bf16, exact products summed in
    fp32: F.linear on the rounded values, with AVX512-BF16 (where the CPU has it) or
    without (the widening path), K not a multiple of 32 included."""
    ops = kernels.cpu_ops()
    assert ops is not None
    if hardware_dot and not ops.bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16")
    ops = copy.copy(ops)
    ops.bf16_dot = hardware_dot
    g = torch.Generator().manual_seed(rows * 5 + k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    ref = torch.nn.functional.linear(x.to(torch.bfloat16).float(), w.float(), bias)
    torch.testing.assert_close(ops.bf16_linear(x, w, bias, round_x=True), ref,
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    acc = torch.randn(rows, n, generator=g)
    out = ops.bf16_linear(x, w, bias, out=acc.clone(), round_x=True)
    torch.testing.assert_close(out, acc + ref, rtol=1e-5, atol=1e-4)


def _int8_weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(512, 768), (1000, 37), (48, 5), (4200, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_kernel_matches_the_dequantized_linear(
    rows: int, k: int, n: int, with_bias: bool
) -> None:
    """x quantized to int16 per row, exact int8 x int16 products: F.linear on the
    dequantized weights within the int16 rounding of x (relative 2^-16 of the row's absmax
    per value); K past the kernel's 2,048-input int32 flush and not a multiple of 16
    included, as is adding into `out`."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(rows * 11 + k + n)
    q, scale = _int8_weights(n, k, g)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, 0] = 40.0  # an outlier sets the row's scale
    bias = torch.randn(n, generator=g) if with_bias else None
    ref = torch.nn.functional.linear(x.double(), (q.double() * scale.double()[:, None]), None)
    if bias is not None:
        ref += bias.double()
    out = ops.int8_linear(x, q, scale, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # the int16 rounding of x: at most half a step of absmax/32767 per value
    bound = (x.abs().amax(dim=1, keepdim=True).double() / 32767 / 2) * (
        q.double().abs() * scale.double()[:, None]
    ).sum(dim=1)
    assert ((out.double() - ref).abs() <= bound * 1.01 + 1e-4).all()
    acc = torch.randn(rows, n, generator=g)
    again = ops.int8_linear(x, q, scale, bias, out=acc.clone())
    torch.testing.assert_close(again, acc + out, rtol=1e-6, atol=1e-5)


@needs_kernel
def test_int8_kernel_takes_a_zero_row() -> None:
    """An all-zero x row (its scale 0) gives the bias, not NaN."""
    ops = kernels.cpu_ops()
    assert ops is not None
    q, scale = _int8_weights(7, 64, torch.Generator().manual_seed(1))
    bias = torch.arange(7, dtype=torch.float32)
    out = ops.int8_linear(torch.zeros(2, 64), q, scale, bias)
    assert torch.equal(out, bias.expand(2, 7))


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_layers_in_one_call_equal_the_layer_by_layer_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """A bf16 checkpoint (bf16 or int8 projections) decoding 3 requests: the layers run in
    one `decode_layers` call give the hidden states of `DecoderLayer.forward_decode`, bit
    for bit (the same kernels in the same order), so the same tokens."""
    from sluice.engine.models.llama import LlamaForCausalLM

    torch.set_num_threads(2)
    prompts = [[5, 9, 31, 17, 2, 44, 8], [3, 12], [40, 41, 42]]
    hidden: list[list[torch.Tensor]] = []
    logits = LlamaForCausalLM.compute_logits

    def recording(
        self: LlamaForCausalLM, h: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        hidden[-1].append(h.clone())
        return logits(self, h, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", recording)
    tokens = []
    for fused in (True, False):
        hidden.append([])
        lm = load_model(
            "tiny-llama", data_dir=tmp_path, dtype="bfloat16", quantization=quantization
        )
        runner = ModelRunner(
            lm.model, EngineConfig(num_kv_blocks=32, block_size=4, dtype="bfloat16")
        )
        assert runner.cpu_ops is not None and runner.decode_plan is not None
        if not fused:
            runner.decode_plan = None
        tokens.append(run_greedy(runner, prompts, 10))
    assert tokens[0] == tokens[1]
    assert len(hidden[0]) == len(hidden[1]) == 10
    assert all(torch.equal(a, b) for a, b in zip(hidden[0], hidden[1], strict=True))


@needs_kernel
def test_a_second_runner_on_the_same_model_leaves_the_first_ones_kv_cache(tmp_path: Path) -> None:
    """The one-call plan holds its runner's KV caches: a runner built later on the same
    model (as a benchmark builds several) does not redirect the first one's decode steps."""
    torch.set_num_threads(2)
    prompts = [[5, 9, 31, 17, 2, 44, 8], [3, 12]]
    config = EngineConfig(num_kv_blocks=32, block_size=4, dtype="bfloat16")
    lm = load_model("tiny-llama", data_dir=tmp_path, dtype="bfloat16")
    alone = run_greedy(ModelRunner(lm.model, config), prompts, 8)
    first = ModelRunner(lm.model, config)
    ModelRunner(lm.model, config)
    assert first.decode_plan is not None
    assert run_greedy(first, prompts, 8) == alone


@needs_kernel
def test_work_sharing_gives_every_chunk_once_at_any_thread_count() -> None:
    """The lm_head-sized GEMV (hundreds of chunks) at 1-4 threads, many calls in a row:
    identical results each time (every chunk run exactly once, none skipped)."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(9)
    w = torch.randn(4000, 512, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 512, generator=g)
    ref = torch.nn.functional.linear(x, w.float())
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for _ in range(50):
                torch.testing.assert_close(ops.bf16_linear(x, w, None), ref, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bf16_kernel_rejects_more_rows_than_it_serves() -> None:
    ops = kernels.cpu_ops()
    assert ops is not None
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        ops.bf16_linear(torch.zeros(kernels.MAX_ROWS + 1, 16), w, None)


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


@needs_kernel
def test_fused_small_ops_match_torch() -> None:
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 72, generator=g), torch.randn(72, generator=g)
    ref = torch.nn.functional.rms_norm(h, (72,), w, 1e-5)
    torch.testing.assert_close(ops.rms_norm(h, w, 1e-5), ref, rtol=1e-5, atol=1e-5)
    gu = torch.randn(2, 2 * 40, generator=g)
    ref = torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]
    torch.testing.assert_close(ops.silu_mul(gu), ref, rtol=1e-5, atol=1e-6)
    # RoPE: the first 3 heads (of 4, head_dim 8) of each row times the complex table
    x = torch.randn(2, 4 * 8, generator=g)
    table = torch.polar(torch.ones(10, 4), torch.rand(10, 4, generator=g) * 6)
    pos = torch.tensor([7, 2])
    ref = x.clone()
    rot = torch.view_as_complex(ref[:, :24].reshape(2, 3, 4, 2)) * table[pos][:, None, :]
    ref[:, :24] = torch.view_as_real(rot).reshape(2, 24)
    ops.rope_(x, 3, torch.view_as_real(table), pos)
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_matches_sdpa(window: int | None, dtype: torch.dtype) -> None:
    """Three requests over scattered blocks (GQA 4 query heads per KV head): the new K|V
    lands in its slot (rounded, in a bf16 cache) and the output equals SDPA over each
    request's visible keys."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 8, 2, 16, 4
    cache = torch.randn(12, bs, 2, hkv, d, generator=g).to(dtype)
    tables = [[3, 7, 1], [5, 2], [9, 10, 11]]
    num_keys = [11, 6, 9]  # the last key of each is this step's token
    table = torch.zeros(3, 3, dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    pairs = list(zip(tables, num_keys, strict=True))
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in pairs])
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g)
    out = ops.attn_decode(qkv, hq, cache, slots, table, torch.tensor(num_keys), window)
    flat = cache.float().view(-1, 2, hkv, d)
    for i, (t, n) in enumerate(pairs):
        torch.testing.assert_close(flat[slots[i]].reshape(-1), qkv[i, hq * d :].to(dtype).float())
        keys = torch.cat([flat[b * bs : (b + 1) * bs] for b in t])[:n]
        if window is not None:
            keys = keys[max(0, n - window) :]
        k = keys[:, 0].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [hq, n, d]
        v = keys[:, 1].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        q = qkv[i, : hq * d].view(hq, 1, d)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).reshape(-1)
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.skipif(not native_low_precision(torch.bfloat16), reason="bf16 is emulated here")
def test_bf16_model_with_native_bf16_decodes_through_the_kernels_with_the_same_tokens(
    tmp_path: Path,
) -> None:
    """Computing in bf16, steps of a few decodes take the fused path (fp32 activations,
    x rounded to bf16 in the GEMV, a bf16 KV cache); the tokens equal the torch path's."""
    torch.set_num_threads(2)
    prompts = [[5, 9, 31, 17, 2, 44, 8], [3, 12, 70, 6], [40, 41, 42]]
    tokens = []
    for fused in (True, False):
        lm = load_model("tiny-llama", data_dir=tmp_path, dtype="bfloat16")
        runner = ModelRunner(
            lm.model, EngineConfig(num_kv_blocks=16, block_size=16, dtype="bfloat16")
        )
        assert runner.dtype == torch.bfloat16 and runner.kv_caches[0].dtype == torch.bfloat16
        assert runner.cpu_ops is not None
        if not fused:
            runner.cpu_ops = None
        tokens.append(run_greedy(runner, prompts, 12))
    assert tokens[0] == tokens[1]


needs_bf16_dot = pytest.mark.skipif(
    kernels.cpu_ops() is None or not kernels.cpu_ops().bf16_dot,  # type: ignore[union-attr]
    reason="no AVX512-BF16 here",
)


@needs_bf16_dot
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 64), (4, 4, 32), (16, 2, 128), (6, 2, 96)])
def test_paged_attention_matches_sdpa_over_each_requests_keys(
    window: int | None, q_dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    """Five requests of 1 to 40 keys over scattered blocks of a bf16 cache, q a strided
    view of the qkv rows: each output equals SDPA in fp32 over that request's keys."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(7)
    bs, lens = 4, [1, 9, 40, 17, 4]
    cache = torch.randn(40, bs, 2, hkv, d, generator=g).to(torch.bfloat16)
    order = torch.randperm(39, generator=g) + 1  # block 0 is the null block
    width = max(-(-n // bs) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    taken = 0
    for i, n in enumerate(lens):
        table[i, : -(-n // bs)] = order[taken : taken + -(-n // bs)]
        taken += -(-n // bs)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16).to(q_dtype)
    q = qkv[:, : hq * d].view(len(lens), hq, d)
    out = ops.attn_paged(q, cache, table, torch.tensor(lens), window)
    assert out.dtype == q_dtype
    flat = cache.float().view(-1, 2, hkv, d)
    for i, n in enumerate(lens):
        keys = torch.cat([flat[b * bs : (b + 1) * bs] for b in table[i].tolist()])[:n]
        if window is not None:
            keys = keys[max(0, n - window) :]
        k = keys[:, 0].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [hq, n, d]
        v = keys[:, 1].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], k, v)
        tol = 1e-2 if q_dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding
        torch.testing.assert_close(out[i].float(), ref[:, 0], rtol=tol, atol=tol)


@needs_bf16_dot
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_rows_of_prefill_chunks_see_their_requests_keys_up_to_them(
    window: int | None,
) -> None:
    """Prefill rows: two requests' chunks (rows 0-4 of request 1, rows 5-8 of request 0),
    each row attending to its request's keys up to its own position, as a causal SDPA."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(11)
    bs, hq, hkv, d = 4, 8, 2, 64
    cache = torch.randn(12, bs, 2, hkv, d, generator=g).to(torch.bfloat16)
    table = torch.tensor([[3, 7, 1], [9, 2, 5]])
    requests = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 0])
    keys = torch.tensor([3, 4, 5, 6, 7, 9, 10, 11, 12])
    q = torch.randn(9, hq, d, generator=g).to(torch.bfloat16)
    out = ops.attn_paged(q, cache, table, keys, window, requests)
    flat = cache.float().view(-1, 2, hkv, d)
    for row, (r, n) in enumerate(zip(requests.tolist(), keys.tolist(), strict=True)):
        kv = torch.cat([flat[b * bs : (b + 1) * bs] for b in table[r].tolist()])[:n]
        kv = kv[max(0, n - window) :] if window else kv
        k = kv[:, 0].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = kv[:, 1].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[row].float()[:, None], k, v)
        torch.testing.assert_close(out[row].float(), ref[:, 0], rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        ops.attn_paged(q, cache, table, keys, window, requests + 1)  # request 2: no row


@needs_bf16_dot
def test_paged_attention_rejects_keys_beyond_the_table() -> None:
    ops = kernels.cpu_ops()
    assert ops is not None
    cache = torch.zeros(4, 4, 2, 2, 32, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 32, dtype=torch.bfloat16)
    table = torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="beyond the block table"):
        ops.attn_paged(q, cache, table, torch.tensor([9]), None)


@needs_bf16_dot
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bf16_model_attends_mixed_steps_on_the_paged_kernel_with_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """Six requests (more than the fused path takes), prompts chunked so decodes share
    steps with prefill chunks: the layers run on the bf16 kernels, the decode group on
    `attn_paged`, and the greedy tokens equal the torch path's (int8 weights too)."""
    torch.set_num_threads(2)
    prompts = [[5, 9, 31, 17, 2, 44, 8], [3, 12], [40, 41, 42], [7] * 13, [1, 2, 3, 4], [60, 9]]
    seen = {"paged": 0}
    paged = kernels.CpuOps.attn_paged

    def counting(self: kernels.CpuOps, *args: object, **kwargs: object) -> torch.Tensor:
        seen["paged"] += 1
        return paged(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels.CpuOps, "attn_paged", counting)
    tokens = []
    for on in (True, False):
        lm = load_model(
            "tiny-llama", data_dir=tmp_path, dtype="bfloat16", quantization=quantization
        )
        runner = ModelRunner(
            lm.model, EngineConfig(num_kv_blocks=32, block_size=4, dtype="bfloat16")
        )
        assert runner.bf16_ops is not None
        if not on:
            runner.bf16_ops = None
            seen["paged_before_off"] = seen["paged"]
        tokens.append(run_greedy(runner, prompts, 10, chunk=3))
    assert tokens[0] == tokens[1]
    assert seen["paged_before_off"] > 0 and seen["paged"] == seen["paged_before_off"]


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_bf16_small_ops_match_torchs_bf16_ops(rows: int) -> None:
    """RMSNorm (fp32 h to bf16), RoPE on bf16 q|k, SiLU*up in bf16 and the residual add
    against the torch ops of `DecoderLayer.forward`: RoPE and the add exactly (the same
    roundings), the others within one bf16 rounding (the sum of squares and exp round
    differently), nearly all exactly."""
    from sluice.engine.models.llama import rms_norm

    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(3)
    h = torch.randn(rows, 256, generator=g) * 3
    w = torch.rand(256, generator=g) + 0.5
    ref = rms_norm(h, w, 1e-6, torch.bfloat16)
    got = ops.rms_norm_bf16(h, w, 1e-6)
    torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=0)
    assert (got == ref).float().mean() > 0.99

    gu = (torch.randn(rows, 2 * 352, generator=g) * 4).to(torch.bfloat16)
    ref = torch.nn.functional.silu(gu[:, :352]).mul_(gu[:, 352:])
    got = ops.silu_mul_bf16(gu)
    torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-30)
    assert (got == ref).float().mean() > 0.99

    heads, d = 6, 32
    qkv = torch.randn(rows, (heads + 2) * d, generator=g).to(torch.bfloat16)
    angles = torch.rand(50, d // 2, generator=g) * 6.3
    table = torch.polar(torch.ones_like(angles), angles)  # complex64, as the model caches
    pos = torch.randint(0, 50, (rows,), generator=g)
    ref = qkv.clone()
    qk = ref[:, : heads * d]
    rot = torch.view_as_complex(qk.float().view(rows, heads, d // 2, 2)) * table[pos][:, None]
    qk.copy_(torch.view_as_real(rot).view(rows, heads * d))
    ops.rope_bf16_(qkv, heads, torch.view_as_real(table), pos)
    assert torch.equal(qkv, ref)

    # the residual add: exactly torch's fp32 h.add_(bf16 y)
    y = (torch.randn(rows, 256, generator=g) * 5).to(torch.bfloat16)
    ref = h.clone().add_(y)
    assert ops.add_bf16_(h, y) is h and torch.equal(h, ref)


@needs_bf16_dot
@pytest.mark.parametrize("width", [1, 15, 33, 100, 32000])
def test_bf16_argmax_equals_numpys_over_the_fp32_row(width: int) -> None:
    """The greedy pick of a bf16 step: the first maximum of each row, ties, a row of -inf,
    a row of one value, NaNs (numpy returns the first), a maximum in the tail that no full
    vector covers."""
    ops = kernels.cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, width, generator=g).to(torch.bfloat16)
    x[1] = float("-inf")
    x[2] = 1.0
    x[3] = torch.randint(0, 3, (width,), generator=g).to(torch.bfloat16)
    x[4, width // 2] = float("nan")
    x[4, -1] = float("nan")
    x[5, -1] = 100.0
    want = torch.from_numpy(x.float().numpy().argmax(axis=-1))
    assert torch.equal(ops.argmax_bf16(x), want)
