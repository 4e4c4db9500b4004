"""LoRA deltas on the CPU kernels (`CpuOps.lora_add`, and inside `decode_layers`) against
the torch path of the same slot weights (`FusedLoRA.add_rows`): odd shapes (rank, K and N
not multiples of 16), rows of four adapters and the base mixed, a slot unloaded, fp32 and
bf16 activations, the AVX-512 form, the AVX2 one and the vdpbf16ps one (bf16 copies of
the weights, within their roundings); and a bf16 engine decoding with adapters through
the one-call plan against the same engine layer by layer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine import kernels
from sluice.engine.backends.base import EngineRequest, LoRARequest
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore
from sluice.engine.loader import load_model, resolve_model_dir
from sluice.engine.models.llama import LlamaForCausalLM
from sluice.engine.models.lora import FusedLoRA, LoRAStep
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.lora_adapters import make_adapter

needs_kernel = pytest.mark.skipif(kernels.cpu_ops() is None, reason="no AVX2/FMA or no C compiler")

SLOTS = 4
# rows of slots 0-3 and the base, unsorted and in runs longer than the kernel's blocks
ROW_SLOTS = [2, -1, 0, 0, 3, 1, 1, 1, 1, 1, 2, -1, 3, 0]


def _ops(wide: bool) -> kernels.CpuOps:
    ops = kernels.cpu_ops()
    assert ops is not None
    if wide and not ops.bf16_dot:
        pytest.skip("this CPU has no AVX-512")
    return ops


def _fused(k: int, out_sizes: list[int], rank: int, g: torch.Generator) -> FusedLoRA:
    """Every slot loaded with random A and B, slot 3 at a smaller rank (zero-padded)."""
    fused = FusedLoRA(k, out_sizes, SLOTS, rank, torch.float32)
    for slot in range(SLOTS):
        r = rank if slot != 3 else max(1, rank // 2)
        for part, n in enumerate(out_sizes):
            a, b = torch.randn(r, k, generator=g), torch.randn(n, r, generator=g)
            fused.set_slot(slot, part, a, b)
        fused.targeted[slot] = 1
    return fused


def _reference(fused: FusedLoRA, x: torch.Tensor, y: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The torch path, row by row."""
    out = y.clone()
    for i, slot in enumerate(rows):
        if slot >= 0:
            fused.add_rows(x, out, slot, i, i + 1)
    return out


def _kernel(
    ops: kernels.CpuOps, fused: FusedLoRA, x: torch.Tensor, y: torch.Tensor, rows: list[int],
    wide: bool,
) -> torch.Tensor:  # fmt: skip
    plan = ops.lora_plan([fused.kernel_proj()], SLOTS, wide=wide)
    out = y.clone()
    ops.lora_add(plan, 0, x, out, torch.tensor(rows, dtype=torch.int64))
    return out


@needs_kernel
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize(
    ("k", "out_sizes", "rank"),
    [(37, [19, 5, 5], 5), (64, [48], 16), (100, [33, 67], 9), (512, [512, 128, 128], 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_equals_the_torch_path(
    wide: bool, k: int, out_sizes: list[int], rank: int, dtype: torch.dtype
) -> None:
    """fp32: equal up to summation order; bf16 x and y: the same fp32 delta added to the
    bf16 y and rounded once, so at most one bf16 step apart where the sums round apart."""
    ops = _ops(wide)
    g = torch.Generator().manual_seed(k + rank)
    fused = _fused(k, out_sizes, rank, g)
    x = torch.randn(len(ROW_SLOTS), k, generator=g).to(dtype)
    y = torch.randn(len(ROW_SLOTS), sum(out_sizes), generator=g).to(dtype)
    want = _reference(fused, x, y, ROW_SLOTS)
    got = _kernel(ops, fused, x, y, ROW_SLOTS, wide)
    base = [i for i, s in enumerate(ROW_SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 0.1}
    torch.testing.assert_close(got, want, **tol)


@needs_kernel
@pytest.mark.parametrize("wide", [True, False])
def test_a_row_of_an_unloaded_slot_gets_no_delta(wide: bool) -> None:
    """A slot cleared (`set_slot` None, untargeted) after the plan was made: the plan reads
    the same tensors, so its rows keep the base output, the other slots' rows their delta."""
    ops = _ops(wide)
    g = torch.Generator().manual_seed(3)
    fused = _fused(40, [24, 8], 6, g)
    x, y = torch.randn(len(ROW_SLOTS), 40, generator=g), torch.randn(len(ROW_SLOTS), 32)
    plan = ops.lora_plan([fused.kernel_proj()], SLOTS, wide=wide)
    for part in range(2):
        fused.set_slot(1, part, None, None)
    out = y.clone()
    ops.lora_add(plan, 0, x, out, torch.tensor(ROW_SLOTS, dtype=torch.int64))
    ones = [i for i, s in enumerate(ROW_SLOTS) if s == 1]
    assert torch.equal(out[ones], y[ones])
    torch.testing.assert_close(out, _reference(fused, x, y, ROW_SLOTS), rtol=1e-5, atol=1e-4)


def _bound(fused: FusedLoRA, x: torch.Tensor, want: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """What bf16 A, B and xa may move each output by, at most: each rounding is within
    2^-9 of its value, so the delta within 3 * 2^-9 of (|x| . |A|^T) . |B| (row by row,
    its slot's), plus the bf16 y's own rounding, one step of |want| (2^-8), either way."""
    mag = torch.zeros_like(want, dtype=torch.float32)
    parts, rank, slots = len(fused.out_sizes), fused.rank, fused.num_slots
    a = fused.a.view(parts * rank, slots, -1).abs()
    b = fused.b.view(parts * rank, slots, -1).abs()
    for i, slot in enumerate(rows):
        if slot >= 0:
            mag[i] = (x[i].float().abs() @ a[:, slot].t()) @ b[:, slot]
    return 3 * 2**-9 * mag + 2**-8 * want.float().abs()


@needs_kernel
@pytest.mark.parametrize(
    ("k", "out_sizes", "rank"),
    [(37, [19, 5, 5], 5), (64, [48], 16), (100, [33, 67], 9), (512, [512, 128, 128], 16)],
)
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
def test_the_bf16_form_equals_the_fp32_path_within_its_roundings(
    k: int, out_sizes: list[int], rank: int, y_dtype: torch.dtype
) -> None:
    """A bf16 x with the bf16 copies (`kernel_proj(bf16=True)`): odd K and ranks, whose
    pairs run past the end zero-padded, within `_bound` of the fp32 torch path; the base
    rows untouched, an fp32 x through the same plan the fp32 form as before."""
    ops = _ops(True)
    g = torch.Generator().manual_seed(k * rank)
    fused = _fused(k, out_sizes, rank, g)
    plan = ops.lora_plan([fused.kernel_proj(bf16=True)], SLOTS, wide=True)
    x = torch.randn(len(ROW_SLOTS), k, generator=g).bfloat16()
    y = torch.randn(len(ROW_SLOTS), sum(out_sizes), generator=g).to(y_dtype)
    slots = torch.tensor(ROW_SLOTS, dtype=torch.int64)
    got = y.clone()
    ops.lora_add(plan, 0, x, got, slots)
    want = _reference(fused, x, y, ROW_SLOTS)
    base = [i for i, s in enumerate(ROW_SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])
    err = (got.float() - want.float()).abs()
    assert (err <= _bound(fused, x, want, ROW_SLOTS)).all(), err.max()
    # fp32 rows through the same plan: the fp32 form, at its own tolerance
    xf, yf = x.float(), y.float()
    out = yf.clone()
    ops.lora_add(plan, 0, xf, out, slots)
    torch.testing.assert_close(out, _reference(fused, xf, yf, ROW_SLOTS), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_the_bf16_copies_follow_a_slot_loaded_or_cleared_after_the_plan() -> None:
    """`set_slot` keeps the bf16 copies in step: slot 1 cleared and slot 2 given new
    weights after the plan was made (in a step's inference mode, as the runner makes it),
    its rows see both, as the fp32 form does."""
    ops = _ops(True)
    g = torch.Generator().manual_seed(5)
    fused = _fused(40, [24, 8], 7, g)
    with torch.inference_mode():
        plan = ops.lora_plan([fused.kernel_proj(bf16=True)], SLOTS, wide=True)
    for part, n in enumerate([24, 8]):
        fused.set_slot(1, part, None, None)
        fused.set_slot(2, part, torch.randn(3, 40, generator=g), torch.randn(n, 3, generator=g))
    x = torch.randn(len(ROW_SLOTS), 40, generator=g).bfloat16()
    y = torch.randn(len(ROW_SLOTS), 32, generator=g).bfloat16()
    out = y.clone()
    ops.lora_add(plan, 0, x, out, torch.tensor(ROW_SLOTS, dtype=torch.int64))
    ones = [i for i, s in enumerate(ROW_SLOTS) if s == 1]
    assert torch.equal(out[ones], y[ones])
    want = _reference(fused, x, y, ROW_SLOTS)
    assert ((out.float() - want.float()).abs() <= _bound(fused, x, want, ROW_SLOTS)).all()


@needs_kernel
def test_lora_add_rejects_a_slot_outside_the_slots() -> None:
    ops = _ops(False)
    fused = _fused(16, [16], 4, torch.Generator().manual_seed(0))
    plan = ops.lora_plan([fused.kernel_proj()], SLOTS)
    for bad in (SLOTS, -2):
        with pytest.raises(RuntimeError, match="adapter slot"):
            rows = torch.tensor([0, bad], dtype=torch.int64)
            ops.lora_add(plan, 0, torch.zeros(2, 16), torch.zeros(2, 16), rows)


@needs_kernel
def test_steps_take_the_kernel_where_it_takes_the_weights(tmp_path: Path) -> None:
    """Any row count with the kernels; the torch path without them or past LORA_COLS."""
    from sluice.engine.models.lora import LoRAWeights

    ops = _ops(False)
    cfg = load_model("tiny-llama", data_dir=tmp_path, dtype="float32").model.config
    weights = LoRAWeights(cfg, SLOTS, torch.float32)
    for layer in weights.layers:
        layer["qkv_proj"].grow(4)
        layer["qkv_proj"].targeted[0] = 1
    weights.rank = 4
    weights.clear(1)  # marks the plan stale, as a load does
    for rows in (1, 4096):
        assert LoRAStep.for_rows(weights, [0] * rows, ops).kernel is not None
        assert LoRAStep.for_rows(weights, [0] * rows).kernel is None
    weights.rank = kernels.LORA_COLS // 3 + 1
    weights.clear(1)
    assert LoRAStep.for_rows(weights, [0] * 4, ops).kernel is None


# ---- a bf16 engine decoding with adapters: the one-call plan against layer by layer ----


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[LoRARequest]]:
    pytest.importorskip("peft")
    torch.set_num_threads(2)
    model_dir = resolve_model_dir("tiny-llama", tmp_path_factory.mktemp("data"))
    root = tmp_path_factory.mktemp("adapters")
    kinds: list[dict[str, Any]] = [
        {"rank": 8},
        {"rank": 5, "alpha": 8},
        {"rank": 7, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]},
    ]
    loras = [
        LoRARequest(f"a{i}", str(make_adapter(model_dir, root / f"a{i}", seed=i + 1, **kind)))
        for i, kind in enumerate(kinds)
    ]
    return model_dir, loras


@needs_kernel
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_decode_with_adapters_in_one_call_equals_the_layer_by_layer_path(
    adapter_paths: tuple[Path, list[LoRARequest]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three adapters and the base decoding together (bf16, 4 rows a step): `decode_layers`
    with the adapters' deltas gives the hidden states of `forward_decode` with the torch
    deltas up to summation order, so the same tokens."""
    model_dir, loras = adapter_paths
    hidden: list[list[torch.Tensor]] = []
    logits = LlamaForCausalLM.compute_logits

    def recording(self: LlamaForCausalLM, h: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        hidden[-1].append(h.clone())
        return logits(self, h, *args, **kw)

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", recording)
    prompts = [[5, 9, 31, 17, 2, 44, 8], [3, 12], [40, 41, 42], [7, 7, 7, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens, fused_calls = [], []
    for fused in (True, False):
        hidden.append([])
        config = EngineConfig(num_kv_blocks=64, block_size=4, dtype="bfloat16", max_loras=4)
        runner = ModelRunner(load_model(model_dir, dtype="bfloat16").model, config)
        assert runner.cpu_ops is not None and runner.decode_plan is not None
        ops = copy.copy(runner.cpu_ops)
        calls = []
        real = ops.decode_layers

        def counting(*args: Any, _real: Any = real, _calls: list[Any] = calls) -> None:
            _calls.append(args[-1])
            _real(*args)

        ops.decode_layers = counting  # type: ignore[method-assign]
        runner.cpu_ops = ops
        runner._lora_ops = ops if fused else None  # None: the torch deltas, layer by layer
        core = EngineCore(config, runner, eos_token_ids=[])
        for i, (prompt, lora) in enumerate(zip(prompts, [*loras, None], strict=True)):
            core.add_request(EngineRequest(f"r{i}", prompt, params, lora_request=lora))
        out: dict[str, list[int]] = {}
        while core.has_unfinished():
            for d in core.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        tokens.append(out)
        fused_calls.append(sum(lora is not None for lora in calls))
        if fused and ops.bf16_dot:  # the prefill chunks' bf16 rows take the vdpbf16ps form
            assert runner.lora_weights is not None
            plan = runner.lora_weights.kernel_plan(ops)
            assert plan is not None and all(p.a16 and p.b16 for p in plan.projs if p.a)
    assert tokens[0] == tokens[1]
    assert fused_calls[0] >= 6 and fused_calls[1] == 0
    assert len(hidden[0]) == len(hidden[1])
    for a, b in zip(hidden[0], hidden[1], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
