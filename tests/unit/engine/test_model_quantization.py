"""Int8 weight-only quantization and the oneDNN-prepacked CPU linears."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sluice.engine import kernels
from sluice.engine.config import EngineConfig
from sluice.engine.loader import load_model
from sluice.engine.models.cpu_linear import (
    TUNE_MAX_ROWS,
    PackedLinear,
    RowPlan,
    can_pack,
    pack_linears,
    row_bucket,
    tune_row_buckets,
)
from sluice.engine.quantization import Int8Linear
from sluice.engine.runner.model_runner import ModelRunner
from tests.unit.engine.runner_driver import run_greedy


def test_int8_linear_is_close_to_dense() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    q = Int8Linear(lin)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (48,)
    x = torch.randn(5, 64)
    ref = lin(x)
    rel = (q(x) - ref).abs().max() / ref.abs().max()
    assert rel < 0.03  # int8 weights + bf16 activations


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN prepack unavailable")
def test_packed_linear_matches_linear() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(PackedLinear(lin)(x), lin(x))
    holder = nn.Module()
    holder.proj = lin
    assert pack_linears(holder, ("proj",), torch.bfloat16) == 1
    assert isinstance(holder.proj, PackedLinear)


def test_row_buckets_pad_at_most_an_eighth_and_stay_few() -> None:
    buckets = {row_bucket(m) for m in range(1, 2049)}
    assert len(buckets) <= 80
    assert all(m <= row_bucket(m) <= m * 1.125 for m in range(1, 2049))
    assert [row_bucket(m) for m in (1, 16, 17, 100, 129, 2048)] == [1, 16, 18, 104, 144, 2048]


@pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN prepack unavailable")
def test_a_packed_linear_pads_its_rows_to_a_bucket_and_returns_only_its_own() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    packed = PackedLinear(lin)
    packed.use(RowPlan())  # every bucket through oneDNN, whatever this CPU measures
    assert packed.weight is None  # no plan uses it: dropped
    _, warmed = tune_row_buckets(packed, 64, deadline=float("inf"))
    assert warmed == len({row_bucket(m) for m in range(1, 65)})
    for rows in (5, 17, 37, 100):  # 17 -> 18, 37 -> 40, 100 -> 104 rows run
        x = torch.randn(rows, 64)
        y = packed(x)
        assert y.shape == (rows, 48)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
        h = torch.ones(rows, 48)
        packed.add_to(x, h)
        torch.testing.assert_close(h, lin(x) + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN prepack unavailable")
def test_the_row_plan_sends_its_buckets_through_f_linear_and_the_rest_through_onednn() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    packed = PackedLinear(lin)
    packed.use(RowPlan(frozenset({4, 18})))
    assert packed.weight is not None  # kept: the plan uses it
    for rows in (4, 17):  # 17 rows are bucket 18: plain, unpadded
        x = torch.randn(rows, 64)
        assert torch.equal(packed(x), lin(x))  # F.linear itself, bit for bit
    x = torch.randn(5, 64)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)  # oneDNN's order


@pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN prepack unavailable")
def test_tuning_plans_only_buckets_it_timed_and_one_plan_serves_each_shape() -> None:
    plan, warmed = tune_row_buckets(PackedLinear(nn.Linear(32, 16)), 512, float("inf"))
    assert warmed == len({row_bucket(m) for m in range(1, 513)})
    assert all(b <= TUNE_MAX_ROWS and b == row_bucket(b) for b in plan.plain)
    _, none_warmed = tune_row_buckets(PackedLinear(nn.Linear(32, 16)), 512, deadline=0.0)
    assert none_warmed == 0  # past the deadline: nothing built, nothing planned

    model = nn.Module()
    model.a, model.b = nn.Module(), nn.Module()
    model.a.proj, model.b.proj = nn.Linear(32, 16), nn.Linear(32, 16)
    model.a.out = nn.Linear(16, 8)
    reference = {name: m.proj(torch.ones(3, 32)) for name, m in (("a", model.a), ("b", model.b))}
    assert pack_linears(model, ("proj", "out"), torch.float32, max_rows=64, budget_s=5.0) == 3
    assert isinstance(model.a.proj, PackedLinear) and isinstance(model.b.proj, PackedLinear)
    assert model.a.proj.plan is model.b.proj.plan  # tuned once for the shape
    for name, m in (("a", model.a), ("b", model.b)):
        torch.testing.assert_close(m.proj(torch.ones(3, 32)), reference[name])


def test_int8_model_mostly_agrees_with_full_precision(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    full = load_model("tiny-llama", data_dir=tmp_path, dtype="float32")
    int8 = load_model("tiny-llama", data_dir=tmp_path, dtype="float32", quantization="int8")
    assert isinstance(int8.model.lm_head, Int8Linear)
    prompt = full.tokenizer.encode("The sluice gate opens and the water")
    cfg = EngineConfig(num_kv_blocks=16, block_size=16)
    hidden_full = run_greedy(ModelRunner(full.model, cfg), [prompt], 1)
    hidden_int8 = run_greedy(ModelRunner(int8.model, cfg), [prompt], 1)
    assert len(hidden_int8[0]) == len(hidden_full[0]) == 1
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        e_full = full.model.embed_tokens(ids)
        e_int8 = int8.model.embed_tokens(ids)
    assert torch.equal(e_full, e_int8)  # embeddings stay full precision


@pytest.mark.skipif(kernels.cpu_ops() is None, reason="no AVX2/FMA or no C compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_decode_steps_run_on_the_int8_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """An int8 model on CPU decodes a few requests on the fused path (its layers in one
    `decode_layers` call, the lm_head on `CpuOps.int8_linear`), whatever the compute
    dtype, and greedy-decodes the tokens of the torch int8 path (bf16 activations there,
    int16 here: both finer than the weights)."""
    torch.set_num_threads(2)
    prompts = [[5, 9, 31, 17, 2, 44, 8], [3, 12], [40, 41, 42]]
    calls = {"int8_linear": 0, "decode_layers": 0}
    for name in calls:
        real = getattr(kernels.CpuOps, name)

        def counting(
            self: kernels.CpuOps, *args: object, _real: Any = real, _name: str = name, **kw: Any
        ) -> object:
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(kernels.CpuOps, name, counting)
    tokens = []
    for on in (True, False):
        lm = load_model("tiny-llama", data_dir=tmp_path, dtype=dtype, quantization="int8")
        runner = ModelRunner(lm.model, EngineConfig(num_kv_blocks=32, block_size=4, dtype=dtype))
        assert runner.cpu_ops is not None and runner.decode_plan is not None
        if on:
            # the prefill's hidden states are fp32 unless the CPU computes bf16 natively;
            # the int8 kernel takes fp32 rows only
            prefill_on_kernel = runner.dtype == torch.float32
        else:
            runner.cpu_ops = None
            for m in lm.model.modules():
                if isinstance(m, Int8Linear):
                    m.ops = None
            before_off = dict(calls)
        tokens.append(run_greedy(runner, prompts, 12))
    # 11 decode steps: the layers in one call, then the lm_head (as for the prefill's 3 rows
    # when they are fp32)
    assert before_off["decode_layers"] == 11
    assert before_off["int8_linear"] == 11 + prefill_on_kernel
    assert calls == before_off
    assert tokens[0] == tokens[1]
