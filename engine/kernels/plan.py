"""The weights the kernels take (`ProjWeights`, `LayerWeights`, `LoRAProj`) and the C
descriptions of a model's decoder layers for `CpuOps.decode_layers` (`DecodePlan`) and of
its LoRA adapters (`LoRAPlan`), checked as they are built."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.engine.kernels.checks import BF16, F32, F32_BF16, I8, U8, bad, tensor

_P = ctypes.c_void_p
_I = ctypes.c_int64
# bytes of a block of 32 weights in `CpuOps.q_linear`, by bits (engine/block_quant.py)
BLOCK_BYTES = {4: 24, 8: 36}


class _Proj(ctypes.Structure):
    _fields_ = [
        ("w", _P), ("scale", _P), ("bias", _P), ("N", _I), ("K", _I),
        ("kind", ctypes.c_int32), ("mode", ctypes.c_int32),
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
        ("blocks", _I), ("positions", _I),
    ]  # fmt: skip


class _LoRA(ctypes.Structure):
    _fields_ = [
        ("a", _P), ("b", _P), ("targeted", _P), ("parts", _I), ("rank", _I), ("slots", _I),
        ("K", _I), ("N", _I), ("off", _I * 4), ("width", _I * 4), ("wide", ctypes.c_int32),
        ("a16", _P), ("b16", _P),
    ]  # fmt: skip


# parts * rank of one projection at most (cpu_ops.c LORA_COLS: the kernel's stack scratch)
LORA_COLS = 1024


@dataclass(frozen=True, slots=True)
class ProjWeights:
    """One projection as the kernels take it: bf16 `weight` (`round_x`: x rounded to bf16
    first, see `CpuOps.bf16_linear`), int8 `weight` with fp32 `scale` per row, or (`bits`
    4 or 8) uint8 `weight` [N, k/32 blocks] of `CpuOps.q_linear`, k its inputs; fp32 bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: torch.Tensor | None = None
    round_x: bool = False
    bits: int = 0
    k: int = 0

    @property
    def in_features(self) -> int:
        return self.k if self.bits else self.weight.shape[1]


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


def check_proj(op: str, name: str, p: ProjWeights, n: int | None, k: int | None) -> int:
    """The output width N of projection `p` after checking its weight ([n, k], bf16, or
    int8 with an fp32 `scale` [N], or blocks of `bits`) and fp32 bias [N]."""
    int8 = p.scale is not None
    if p.bits:
        if p.bits not in BLOCK_BYTES or p.k <= 0 or p.k % 32 or (k is not None and p.k != k):
            raise bad(op, f"{name}: {p.bits}-bit blocks of {p.k} inputs, expected {k}")
        n_out, _ = tensor(op, f"{name}.weight", p.weight, U8, (n, p.k // 32 * BLOCK_BYTES[p.bits]))
    else:
        n_out, _ = tensor(op, f"{name}.weight", p.weight, I8 if int8 else BF16, (n, k))
    if p.scale is not None:
        tensor(op, f"{name}.scale", p.scale, F32, (n_out,))
    if p.bias is not None:
        tensor(op, f"{name}.bias", p.bias, F32, (n_out,))
    return n_out


def _proj(p: ProjWeights, mode: dict[bool, int], vnni: int) -> _Proj:
    kind = p.bits or int(p.scale is not None)
    return _Proj(
        p.weight.data_ptr(), _ptr(p.scale), _ptr(p.bias), p.weight.shape[0],
        p.in_features, kind, vnni if p.bits else mode[p.round_x],
    )  # fmt: skip


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_layer(op: str, i: int, lw: LayerWeights, h: int, inter: int, q: int, kv: int) -> None:
    """Layer i's weights against the model's sizes (hidden h, intermediate `inter`, q and
    K|V widths): a wrong one would be read past its end by every step."""
    name = f"layers[{i}]"
    tensor(op, f"{name}.in_norm", lw.in_norm, F32, (h,))
    tensor(op, f"{name}.post_norm", lw.post_norm, F32, (h,))
    check_proj(op, f"{name}.qkv", lw.qkv, q + kv, h)
    check_proj(op, f"{name}.o", lw.o, h, q)
    check_proj(op, f"{name}.gate_up", lw.gate_up, 2 * inter, h)
    check_proj(op, f"{name}.down", lw.down, h, inter)


def _check_caches(
    op: str, caches: Sequence[torch.Tensor], block_size: int, kv_heads: int, head_dim: int
) -> int:
    """The caches' block count after checking they are alike: [blocks, block_size, 2,
    kv_heads, head_dim], fp32 or bf16, contiguous."""
    shape = (None, block_size, 2, kv_heads, head_dim)
    blocks = tensor(op, "kv_caches[0]", caches[0], F32_BF16, shape)[0]
    for i, c in enumerate(caches):
        tensor(op, f"kv_caches[{i}]", c, (caches[0].dtype,), (blocks, *shape[1:]))
    return blocks


def _layer(lw: LayerWeights, cache: torch.Tensor, mode: dict[bool, int], vnni: int) -> _Layer:
    return _Layer(
        lw.in_norm.data_ptr(), lw.post_norm.data_ptr(), _proj(lw.qkv, mode, vnni),
        _proj(lw.o, mode, vnni), _proj(lw.gate_up, mode, vnni), _proj(lw.down, mode, vnni),
        cache.data_ptr(), lw.window or 0,
    )  # fmt: skip


def build_plan(
    layers: Sequence[LayerWeights],
    mode: dict[bool, int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    eps: float,
    rope: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    vnni: bool = False,
) -> DecodePlan:
    """`CpuOps.decode_plan`, `mode` the GEMV mode of round_x False and True, `vnni` the
    block kernels' (`CpuOps.q_linear`)."""
    op = "decode_plan"
    if not layers or len(layers) != len(kv_caches):
        raise bad(op, f"one KV cache a layer, got {len(kv_caches)} for {len(layers)} layers")
    if not (kv_heads > 0 and heads % kv_heads == 0 and head_dim % 2 == 0 and block_size > 0):
        raise bad(
            op,
            f"heads {heads} a multiple of kv_heads {kv_heads}, head_dim {head_dim} even, "
            f"block_size {block_size} > 0",
        )
    blocks = _check_caches(op, kv_caches, block_size, kv_heads, head_dim)
    positions = tensor(op, "rope", rope, F32, (None, head_dim // 2, 2))[0]
    h = tensor(op, "layers[0].in_norm", layers[0].in_norm, F32, (None,))[0]
    inter = layers[0].down.in_features  # checked with the rest of layer 0 below
    for i, lw in enumerate(layers):
        _check_layer(op, i, lw, h, inter, heads * head_dim, 2 * kv_heads * head_dim)
    array = (_Layer * len(layers))(
        *(_layer(lw, cache, mode, int(vnni)) for lw, cache in zip(layers, kv_caches, strict=True))
    )
    model = _Model(
        len(layers), h, inter, heads, kv_heads, head_dim, block_size, eps, head_dim**-0.5,
        rope.data_ptr(), int(kv_caches[0].dtype == torch.bfloat16), 1, 0, blocks, positions,
    )  # fmt: skip
    return DecodePlan(model, array, (tuple(layers), tuple(kv_caches), rope))


@dataclass(frozen=True, slots=True)
class LoRAProj:
    """One fused projection's adapters, every slot, as `CpuOps.lora_add` reads them (the
    layout of `engine.models.lora.FusedLoRA`): fp32 A `a` [P, R, S, K] and B `b` [P, R, S,
    N], part p's B zero outside its `widths[p]` columns (the parts in order, the scale
    folded in); `targeted` uint8 [S], whether slot s's adapter has this projection.
    `a16`, `b16`: None, or bf16 copies for the `vdpbf16ps` form, which a bf16 x takes on a
    CPU with AVX512-BF16: A as `a`, B in pairs along the rank [P, (R + 1) / 2, S, N, 2]
    (an odd rank's last pair zero in its second half)."""

    a: torch.Tensor
    b: torch.Tensor
    widths: tuple[int, ...]
    targeted: torch.Tensor
    a16: torch.Tensor | None = None
    b16: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LoRAPlan:
    """Projections' adapters for `CpuOps.lora_add` and `decode_layers` (per layer its qkv,
    o, gate_up and down, in that order); it holds the tensors whose addresses it keeps, so
    it stays valid while they are written in place (a slot loaded or cleared)."""

    projs: ctypes.Array[_LoRA]
    keep: tuple[object, ...]


@dataclass(frozen=True, slots=True)
class LoRARows:
    """A step's adapters: the plan and each flat row's slot (int64 [rows], -1: base)."""

    plan: LoRAPlan
    row_slots: torch.Tensor


def _lora(op: str, i: int, p: LoRAProj | None, slots: int, wide: bool, bf16: bool) -> _LoRA:
    if p is None:  # no adapter has this projection: the kernel adds nothing
        return _LoRA(None, None, None, 1, 0, slots, 0, 0)
    parts, rank, s, k = tensor(op, f"projs[{i}].a", p.a, F32, (len(p.widths), None, slots, None))
    n = sum(p.widths)
    tensor(op, f"projs[{i}].b", p.b, F32, (parts, rank, s, n))
    tensor(op, f"projs[{i}].targeted", p.targeted, U8, (slots,))
    if not 1 <= parts <= 4 or parts * rank > LORA_COLS:
        raise bad(op, f"projs[{i}]: 1..4 parts of parts * rank <= {LORA_COLS}")
    a16 = b16 = None
    if bf16 and p.a16 is not None and p.b16 is not None:
        tensor(op, f"projs[{i}].a16", p.a16, BF16, (parts, rank, s, k))
        tensor(op, f"projs[{i}].b16", p.b16, BF16, (parts, (rank + 1) // 2, s, n, 2))
        a16, b16 = p.a16.data_ptr(), p.b16.data_ptr()
    offsets = [sum(p.widths[:j]) for j in range(parts)]
    return _LoRA(
        p.a.data_ptr(), p.b.data_ptr(), p.targeted.data_ptr(), parts, rank, slots, k, n,
        (_I * 4)(*offsets), (_I * 4)(*p.widths), int(wide), a16, b16,
    )  # fmt: skip


def build_lora_plan(
    projs: Sequence[LoRAProj | None], slots: int, wide: bool, bf16: bool
) -> LoRAPlan:
    """`CpuOps.lora_plan`: `wide`, the AVX-512F form of the kernel; `bf16`, the
    `vdpbf16ps` form for a bf16 x where a projection has its bf16 copies."""
    op = "lora_plan"
    array = (_LoRA * len(projs))(*(_lora(op, i, p, slots, wide, bf16) for i, p in enumerate(projs)))
    return LoRAPlan(array, tuple(projs))
