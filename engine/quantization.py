"""Int8 weight-only quantization: per-output-channel symmetric scales, applied after loading.

Called by `engine.loader.load_model(..., quantization="int8")`; swaps every projection
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj` and `lm_head`) of a loaded
`LlamaForCausalLM` for an `Int8Linear`. Embeddings and norms stay in the model dtype.

Kernel choice: the fused `aten._weight_int8pack_mm` (int8 weights, bf16 activations,
scales applied in the kernel) beats dequantize-then-matmul and dense bf16 for batch-1
decode GEMVs; in fp32 it is very slow, so fp32 models run the
int8 matmul with bf16 activations and cast back. On CPU the runner also hands each layer
the native kernels (`use_kernels`): fp32 inputs of at most `kernels.MAX_ROWS` rows (the
fused decode path) then take `CpuOps.int8_linear`, which streams the int8 weights once
and returns fp32, whatever dtype the model computes in.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine import kernels


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
        self.ops: kernels.CpuOps | None = None  # see use_kernels
        self.kernel: kernels.ProjWeights | None = None

    def use_kernels(self, ops: kernels.CpuOps) -> None:
        """Serve fp32 inputs of at most `kernels.MAX_ROWS` rows with `ops.int8_linear` (an
        fp32 result); the kernel takes fp32 scales and bias, kept beside (N floats each)."""
        self.ops = ops
        bias = None if self.bias is None else self.bias.detach().float()
        self.kernel = kernels.ProjWeights(
            self.qweight, bias, scale=self.scales.float().contiguous()
        )

    def set_output_dtype(self, dtype: torch.dtype) -> None:
        """Return `dtype` from now on; the scales stay in the activation dtype (after a
        module-wide `.to(dtype)`, which casts every floating buffer)."""
        self.out_dtype = dtype
        self.act_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
        self.scales = self.scales.to(self.act_dtype)

    def kernel_weights(self) -> kernels.ProjWeights | None:
        """The int8 weight as `CpuOps.decode_layers` takes it, once on the kernels."""
        return None if self.ops is None else self.kernel

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias); with `out`, added into it (one kernel call on the kernel path)."""
        if (
            self.ops is not None
            and x.dim() == 2
            and x.shape[0] <= kernels.MAX_ROWS
            and x.dtype == torch.float32
        ):
            k = self.kernel
            assert k is not None and k.scale is not None
            return self.ops.int8_linear(x.contiguous(), k.weight, k.scale, k.bias, out=out)
        y = self._torch_forward(x)
        return y if out is None else out.add_(y)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> None:
        """h += forward(x)."""
        self.forward(x, out=h)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
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
