"""The CPU kernels refuse what would make them read or write out of bounds: a block id, a
slot, a request row or a position past the cache (or table) they index raises from the C
code before anything is written, and a tensor of the wrong dtype, layout, device or shape
raises a ValueError naming the argument before the C code is called."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sluice.engine import kernels
from sluice.engine.kernels import checks

needs_kernel = pytest.mark.skipif(kernels.cpu_ops() is None, reason="no AVX2/FMA or no C compiler")
needs_bf16_dot = pytest.mark.skipif(
    kernels.cpu_ops() is None or not kernels.cpu_ops().bf16_dot,  # type: ignore[union-attr]
    reason="no AVX512-BF16 here",
)

HQ, HKV, D, BS, BLOCKS, HIDDEN, INTER = 4, 2, 16, 4, 8, 64, 96


def _ops() -> kernels.CpuOps:
    ops = kernels.cpu_ops()
    assert ops is not None
    return ops


class _Step:
    """One fused decode step of two requests over a small fp32 cache: request 0 at position
    5 (blocks 1, 2), request 1 at position 2 (block 3)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.cache = torch.randn(BLOCKS, BS, 2, HKV, D, generator=g)
        self.qkv = torch.randn(2, (HQ + 2 * HKV) * D, generator=g)
        self.table = torch.tensor([[1, 2], [3, 0]])
        self.positions = torch.tensor([5, 2])
        self.slots = torch.tensor([2 * BS + 1, 3 * BS + 2])
        self.num_keys = self.positions + 1

    def attn(self, **change: torch.Tensor) -> torch.Tensor:
        args = {"slots": self.slots, "table": self.table, "num_keys": self.num_keys} | change
        return _ops().attn_decode(
            change.get("qkv", self.qkv), HQ, change.get("kv_cache", self.cache),
            args["slots"], args["table"], args["num_keys"], None,
        )  # fmt: skip


def _proj(n: int, k: int, g: torch.Generator) -> kernels.ProjWeights:
    return kernels.ProjWeights(torch.randn(n, k, generator=g).to(torch.bfloat16), None)


def _plan(caches: list[torch.Tensor], rope: torch.Tensor) -> kernels.DecodePlan:
    g = torch.Generator().manual_seed(2)
    layer = kernels.LayerWeights(
        torch.ones(HIDDEN), torch.ones(HIDDEN), _proj((HQ + 2 * HKV) * D, HIDDEN, g),
        _proj(HIDDEN, HQ * D, g), _proj(2 * INTER, HIDDEN, g), _proj(HIDDEN, INTER, g), None,
    )  # fmt: skip
    return _ops().decode_plan(
        [layer] * len(caches), heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS, eps=1e-5,
        rope=rope, kv_caches=caches,
    )  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("block", [-1, BLOCKS, 1 << 40])
def test_a_block_id_past_the_cache_raises_and_writes_nothing(block: int) -> None:
    step = _Step()
    before = step.cache.clone()
    table = step.table.clone()
    table[0, 1] = block  # the block of request 0's keys 4..5
    with pytest.raises(RuntimeError, match=r"attn_decode failed \(-4\): a block id"):
        step.attn(table=table)
    assert torch.equal(step.cache, before)  # not even the new K|V went in


@needs_kernel
@pytest.mark.parametrize("slot", [-1, BLOCKS * BS, 1 << 40])
def test_a_slot_past_the_cache_raises_and_writes_nothing(slot: int) -> None:
    step = _Step()
    before = step.cache.clone()
    with pytest.raises(RuntimeError, match=r"attn_decode failed \(-5\): a slot id"):
        step.attn(slots=torch.tensor([step.slots[0].item(), slot]))
    assert torch.equal(step.cache, before)


@needs_kernel
def test_keys_past_the_block_table_row_raise() -> None:
    step = _Step()
    with pytest.raises(RuntimeError, match=r"\(-3\): a row's num_keys"):
        step.attn(num_keys=torch.tensor([2 * BS + 1, 3]))
    with pytest.raises(RuntimeError, match=r"\(-3\): a row's num_keys"):
        step.attn(num_keys=torch.tensor([0, 3]))


@needs_kernel
def test_decode_layers_check_every_id_once_for_the_step() -> None:
    """The fused step: a bad block, slot or position raises before any layer runs (the
    caches and hidden states stay as they were); the good step runs."""
    step = _Step()
    caches = [step.cache.clone(), step.cache.clone()]
    plan = _plan(caches, torch.randn(16, D // 2, 2))
    h = torch.randn(2, HIDDEN)
    ops, before = _ops(), [c.clone() for c in caches]
    bad_table = step.table.clone()
    bad_table[1, 0] = BLOCKS
    cases = [
        (step.positions, step.slots, bad_table, r"\(-4\): a block id"),
        (step.positions, torch.tensor([3, BLOCKS * BS]), step.table, r"\(-5\): a slot id"),
        (torch.tensor([5, 16]), step.slots, step.table, r"\(-7\): a position"),
    ]
    for positions, slots, table, message in cases:
        h_in = h.clone()
        with pytest.raises(RuntimeError, match=message):
            ops.decode_layers(plan, h_in, positions, slots, table, positions + 1)
        assert torch.equal(h_in, h)
        assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    ops.decode_layers(plan, h, step.positions, step.slots, step.table, step.num_keys)
    assert not torch.equal(caches[0], before[0])  # the good step wrote its K|V


@needs_kernel
def test_a_position_past_the_rope_table_raises() -> None:
    x = torch.randn(2, 4 * 8)
    with pytest.raises(RuntimeError, match=r"rope_ failed \(-7\): a position"):
        _ops().rope_(x, 3, torch.randn(10, 4, 2), torch.tensor([3, 10]))


@needs_kernel
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slots": torch.tensor([9, 14], dtype=torch.int32)}, "slots must be int64, got int32"),
        ({"kv_cache": torch.zeros(BLOCKS, BS, 2, HKV, D, dtype=torch.float16)},
         "kv_cache must be float32 or bfloat16, got float16"),
        ({"qkv": torch.zeros(2, (HQ + 2 * HKV) * D, dtype=torch.float64)},
         "qkv must be float32, got float64"),
    ],
)  # fmt: skip
def test_a_wrong_dtype_raises_naming_the_argument(
    change: dict[str, torch.Tensor], message: str
) -> None:
    with pytest.raises(ValueError, match=f"attn_decode: {message}"):
        _Step().attn(**change)


@needs_kernel
def test_a_non_contiguous_tensor_raises_naming_the_argument() -> None:
    step, ops = _Step(), _ops()
    wide = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="attn_decode: table must be contiguous"):
        step.attn(table=wide[:, ::2])  # every other column: a strided view
    with pytest.raises(ValueError, match="rms_norm: h must be contiguous"):
        ops.rms_norm(torch.randn(HIDDEN, 2).t(), torch.ones(HIDDEN), 1e-5)
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"linear: proj\.weight must be contiguous"):
        ops.bf16_linear(torch.zeros(1, 16), w.t(), None)
    # rows of the qkv output may be apart by more than a row, not have holes inside a row
    columns = torch.randn((HQ + 2 * HKV) * D, 2).t()
    with pytest.raises(ValueError, match="attn_decode: qkv must have contiguous rows"):
        step.attn(qkv=columns)


@needs_kernel
def test_a_wrong_shape_raises_naming_the_argument() -> None:
    step, ops = _Step(), _ops()
    shaped = r"attn_decode: table must be shaped \[2, \*\], got \[3, 2\]"
    with pytest.raises(ValueError, match=shaped):
        step.attn(table=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attn_decode: num_keys must be shaped \[2\]"):
        step.attn(num_keys=torch.tensor([[6], [3]]))
    with pytest.raises(ValueError, match=r"rms_norm: weight must be shaped \[64\], got \[32\]"):
        ops.rms_norm(torch.zeros(2, HIDDEN), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match=r"linear: proj\.weight must be shaped \[\*, 16\]"):
        ops.bf16_linear(torch.zeros(1, 16), torch.zeros(8, 12, dtype=torch.bfloat16), None)
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"linear: proj\.bias must be shaped \[8\]"):
        ops.bf16_linear(torch.zeros(1, 16), w, torch.ones(9))


@needs_kernel
def test_a_plan_checks_its_caches_and_weights() -> None:
    """A plan keeps raw pointers for every later step: its caches must all be alike and
    each weight shaped as the model's sizes say."""
    cache = torch.zeros(BLOCKS, BS, 2, HKV, D)
    rope = torch.randn(16, D // 2, 2)
    shaped = r"decode_plan: kv_caches\[1\] must be shaped \[8, 4, 2, 2, 16\]"
    with pytest.raises(ValueError, match=shaped):
        _plan([cache, torch.zeros(BLOCKS + 1, BS, 2, HKV, D)], rope)
    with pytest.raises(ValueError, match=r"decode_plan: rope must be shaped \[\*, 8, 2\]"):
        _plan([cache], torch.randn(16, D, 2))


@needs_kernel
def test_a_tensor_off_the_cpu_raises_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="rms_norm: h must be on the CPU, got meta"):
        _ops().rms_norm(torch.empty(2, HIDDEN, device="meta"), torch.ones(HIDDEN), 1e-5)


@needs_kernel
def test_a_non_tensor_raises_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="attn_decode: slots must be a tensor, got list"):
        _Step().attn(slots=[9, 14])  # type: ignore[arg-type]


@needs_bf16_dot
def test_paged_attention_rejects_a_block_id_past_the_cache() -> None:
    ops = _ops()
    cache = torch.zeros(4, 4, 2, 2, 32, dtype=torch.bfloat16)
    q = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    table = torch.tensor([[1, 2], [3, 4]])  # row 1's block 4 is past the 4 blocks
    with pytest.raises(RuntimeError, match=r"attn_paged failed \(-4\): a block id"):
        ops.attn_paged(q, cache, table, torch.tensor([5, 5]), None)
    with pytest.raises(ValueError, match="attn_paged: kv_cache must be bfloat16, got float32"):
        ops.attn_paged(q, cache.float(), table, torch.tensor([5, 3]), None)
    # a window past a bad block: only the blocks holding the window's keys are read
    windowed = torch.tensor([[1, 2], [99, 3]])
    out = ops.attn_paged(q, cache, windowed, torch.tensor([5, 5]), 1)
    assert out.shape == q.shape


def test_every_c_return_code_has_one_message() -> None:
    """checks.ERRORS has exactly cpu_ops.c's SLUICE_E_* codes, each with its own message."""
    source = (Path(kernels.__file__).parent / "cpu_ops.c").read_text()
    codes = {int(v) for v in re.findall(r"SLUICE_E_\w+ = (-\d+),", source)}
    assert codes and codes == set(checks.ERRORS)
    assert len({what for _, what in checks.ERRORS.values()}) == len(checks.ERRORS)
    for rc, (kind, what) in checks.ERRORS.items():
        err = checks.error("attn_decode", rc)
        assert isinstance(err, kind) and str(err) == f"attn_decode failed ({rc}): {what}"
