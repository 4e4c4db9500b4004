"""Int8 weight-only quantization: per-output-channel symmetric scales, applied after loading.

Called by `engine.loader.load_model(..., quantization="int8")`; swaps every projection
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj` and `lm_head`) of a loaded
`LlamaForCausalLM` for an `Int8Linear`. Embeddings and norms stay in the model dtype.

Kernel choice: the fused `aten._weight_int8pack_mm` (int8 weights, bf16 activations,
scales applied in the kernel) beats dequantize-then-matmul and dense bf16 for batch-1
decode GEMVs (benchmarks/RESULTS.md); in fp32 it is very slow, so fp32 models run the
int8 matmul with bf16 activations and cast back.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, with q int8 [out, in] and one scale per output row."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.out_dtype = linear.weight.dtype
        self.act_dtype = torch.bfloat16 if self.out_dtype == torch.float32 else self.out_dtype
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scale.to(self.act_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def set_output_dtype(self, dtype: torch.dtype) -> None:
        """Return `dtype` from now on; the scales stay in the activation dtype (after a
        module-wide `.to(dtype)`, which casts every floating buffer)."""
        self.out_dtype = dtype
        self.act_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
        self.scales = self.scales.to(self.act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.act_dtype)
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        y = y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y


_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the model's projections (and an untied lm_head) with Int8Linear, in place."""
    for layer in getattr(model, "layers", []):
        for name in _TARGETS:
            setattr(layer, name, Int8Linear(getattr(layer, name)))
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, nn.Linear):  # when tied, the embedding keeps its own copy
        model.lm_head = Int8Linear(lm_head)
    return model
