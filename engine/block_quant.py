"""GGUF projections kept in quantized blocks of 32 weights (`BlockQuantLinear`).

Called by `engine.loader` when a quantized GGUF is loaded with `quantization="gguf"` (asked
for, not the default: the kernel wins a batch-1 step but loses to the de-quantized weights'
GEMMs from a few rows on): every projection whose GGUF tensors are Q4_0, Q4_1, Q4_K
or Q8_0 keeps its blocks, repacked once into the one layout `CpuOps.q_linear` reads, and
the lm_head of a tied model gets such a copy of the embedding's blocks (the embedding
itself stays de-quantized: a lookup reads a few rows). Other types (Q5_*, Q6_K, F16, ...)
stay de-quantized, as they are without this module.

Layout, per row of K weights, K/32 blocks: 4-bit blocks {fp32 d, fp32 m, 16 bytes} with
w = d * q + m, q in 0..15 and byte j holding weight j (low nibble) and j + 16 (high), as
GGML's Q4_0/Q4_1 do; Q4_0 is m = -8 d, and Q4_K's per-32 6-bit scales and mins fold into
d and m exactly (an fp16 times a 6-bit integer is exact in fp32). 8-bit blocks {fp32 d,
32 int8} with w = d * q (Q8_0). So a weight de-quantizes to the same fp32 value as
`gguf.quants.dequantize` gives, and the projection differs from the de-quantized one only
by the kernel's int8 activations (each x block quantized to int8 with its own scale).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from torch import nn

from sluice.engine import kernels
from sluice.engine.kernels.plan import BLOCK_BYTES
from sluice.engine.models.llama import LlamaForCausalLM, interleave_rope_rows

QK = 32
_Q = GGMLQuantizationType
# the GGUF types kept in blocks, and the bits of their repacked form
BITS = {_Q.Q4_0: 4, _Q.Q4_1: 4, _Q.Q4_K: 4, _Q.Q8_0: 8}


def _f16(a: np.ndarray) -> np.ndarray:
    return a.copy().view(np.float16).astype(np.float32)


def _q4_blocks(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[n, 24] blocks from fp32 d, m [n] and nibbles q [n, 16] (byte j: weights j, j+16)."""
    out = np.empty((d.shape[0], BLOCK_BYTES[4]), dtype=np.uint8)
    out[:, 0:4] = d.astype(np.float32).reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = m.astype(np.float32).reshape(-1, 1).view(np.uint8)
    out[:, 8:] = q
    return out


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, k: int) -> np.ndarray:
    """A GGUF tensor's raw blocks (uint8, rows x k weights) -> uint8 [rows, k/32 * bytes]."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, _gguf_block_bytes(qtype))
    if qtype == _Q.Q8_0:
        out = np.empty((blocks.shape[0], BLOCK_BYTES[8]), dtype=np.uint8)
        out[:, 0:4] = _f16(blocks[:, 0:2]).reshape(-1, 1).view(np.uint8)
        out[:, 4:] = blocks[:, 2:]
    elif qtype == _Q.Q4_0:
        d = _f16(blocks[:, 0:2]).ravel()
        out = _q4_blocks(d, -8.0 * d, blocks[:, 2:])
    elif qtype == _Q.Q4_1:
        out = _q4_blocks(_f16(blocks[:, 0:2]).ravel(), _f16(blocks[:, 2:4]).ravel(), blocks[:, 4:])
    elif qtype == _Q.Q4_K:
        out = _repack_q4_k(blocks)
    else:
        raise ValueError(f"{qtype.name} is not kept in blocks")
    return out.reshape(rows, (k // QK) * out.shape[1])


def _repack_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks of 256 -> 8 4-bit blocks each: sub-block 2i is the low nibbles
    of bytes 32i..32i+31, 2i+1 their high nibbles; scale d * sc, min -dmin * mn."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n * 8, 32)
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    scale = (d * sc.astype(np.float32)).ravel()
    minimum = -(dmin * mn.astype(np.float32)).ravel()
    return _q4_blocks(scale, minimum, nibbles)


def _gguf_block_bytes(qtype: GGMLQuantizationType) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


def dequantize(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The fp32 weight [N, k] of repacked blocks `packed` (the torch path's weight)."""
    n = packed.shape[0]
    b = packed.reshape(n, k // QK, BLOCK_BYTES[bits])
    d = b[..., 0:4].contiguous().view(torch.float32)
    if bits == 8:
        q = b[..., 4:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    m = b[..., 4:8].contiguous().view(torch.float32)
    nib = b[..., 8:]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()
    return (q * d + m).reshape(n, k)


class BlockQuantLinear(nn.Module):
    """y = x @ W.T (+ bias) for W in repacked blocks (`packed` uint8 [N, K/32 * bytes]).

    The result has the input's dtype (fp32 in the fused decode path, whatever the model
    computes in). On the kernels (`use_kernels`) every input takes `CpuOps.q_linear`;
    without them the weight is de-quantized for each call (a fallback, not a fast path)."""

    packed: torch.Tensor

    def __init__(
        self, packed: torch.Tensor, bits: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if in_features % QK or packed.shape[1] != in_features // QK * BLOCK_BYTES[bits]:
            raise ValueError(f"{tuple(packed.shape)} is not {bits}-bit blocks of {in_features}")
        self.register_buffer("packed", packed.contiguous())
        self.bits, self.in_features, self.out_features = bits, in_features, packed.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)
        self.ops: kernels.CpuOps | None = None
        self.kernel: kernels.ProjWeights | None = None

    def use_kernels(self, ops: kernels.CpuOps) -> None:
        self.ops = ops
        bias = None if self.bias is None else self.bias.detach().float()
        self.kernel = kernels.ProjWeights(self.packed, bias, bits=self.bits, k=self.in_features)

    def kernel_weights(self) -> kernels.ProjWeights | None:
        """The blocks as `CpuOps.decode_layers` takes them, once on the kernels."""
        return None if self.ops is None else self.kernel

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias); with `out`, added into it (in the kernel for fp32 [M, N])."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.ops is None or self.kernel is None or x2.shape[0] == 0:
            return self._torch_forward(x2, shape, out)
        if x.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        if out is not None and out.dim() == 2 and out.dtype in (torch.float32, torch.bfloat16):
            self.ops.q_linear(x2, self.kernel, out=out)
            return out
        y = self.ops.q_linear(x2, self.kernel, dtype=x2.dtype)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if out is None else out.add_(y)

    def _torch_forward(
        self, x2: torch.Tensor, shape: torch.Size, out: torch.Tensor | None
    ) -> torch.Tensor:
        w = dequantize(self.packed, self.bits, self.in_features)
        y = x2.float() @ w.T
        if self.bias is not None:
            y = y + self.bias
        y = y.to(x2.dtype).reshape(*shape[:-1], self.out_features)
        return y if out is None else out.add_(y)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> None:
        """h += forward(x)."""
        self.forward(x, out=h)


def fuse(
    parts: Sequence[tuple[np.ndarray, GGMLQuantizationType]], k: int
) -> tuple[torch.Tensor, int] | None:
    """The repacked blocks of row-stacked GGUF tensors (each raw, type) and their bits, or
    None unless every part is of one kept kind of block."""
    bits = {BITS.get(t) for _, t in parts}
    if len(bits) != 1 or None in bits:
        return None
    rows = [repack(np.asarray(raw), t, raw.shape[0], k) for raw, t in parts]
    return torch.from_numpy(np.concatenate(rows, axis=0)), bits.pop()  # type: ignore[return-value]


# the fused projections of a decoder layer and the Hugging Face tensors stacked in each
_FUSED = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


def keep_blocks(
    net: LlamaForCausalLM, blocks: dict[str, tuple[np.ndarray, GGMLQuantizationType]]
) -> int:
    """Swap every projection of `net` (loaded de-quantized) whose GGUF tensors, `blocks`
    by Hugging Face name (`GGUFCheckpoint.quantized_blocks`), are all of one kept kind for
    a BlockQuantLinear, the lm_head too (a tied one from the embedding's blocks); q/k rows
    reordered as `load_hf_state` reorders them. Returns how many were swapped."""
    cfg, swapped = net.config, 0
    rope_heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for i, layer in enumerate(net.layers):
        for target, names in _FUSED.items():
            parts = [blocks.get(f"model.layers.{i}.{n}") for n in names]
            if any(p is None for p in parts):
                continue
            rows = []
            for n, part in zip(names, parts, strict=True):
                raw, kind = part  # type: ignore[misc]
                heads = rope_heads.get(n.split(".")[-2])
                if heads is not None:
                    raw = interleave_rope_rows(
                        torch.from_numpy(np.asarray(raw)), heads, cfg.head_dim
                    ).numpy()
                rows.append((raw, kind))
            old = getattr(layer, target)
            fused = fuse(rows, old.in_features)
            if fused is not None:
                setattr(layer, target, BlockQuantLinear(*fused, old.in_features, old.bias))
                swapped += 1
    head = blocks.get("lm_head.weight") or (
        blocks.get("model.embed_tokens.weight") if cfg.tie_word_embeddings else None
    )
    fused = None if head is None else fuse([head], cfg.hidden_size)
    if fused is not None:
        setattr(net, "lm_head", BlockQuantLinear(*fused, cfg.hidden_size, None))  # noqa: B010
        swapped += 1
    return swapped
