"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache: the model the runner calls.

Sits under `engine.runner`: the runner builds flat inputs and attention metadata once per step
and calls `LlamaForCausalLM.forward`; the loader maps Hugging Face safetensors names onto it.
Supports RMSNorm, RoPE (default, linear and llama3 scaling), GQA, SwiGLU, qkv bias (Qwen2),
a sliding window (Mistral; mask-only) and tied embeddings.

Layout choices for speed on CPU: q/k/v and gate/up are fused into one matmul each, and the
rows of the q and k projections are permuted per head from Hugging Face's half-split RoPE
layout to an interleaved one, so RoPE is one complex multiply. Attention scores are
unchanged by the permutation (the same one applies to q and k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.kernels import CpuOps, DecodePlan, LayerWeights, ProjWeights
from sluice.engine.runner.attention import AttentionMetadata, paged_attention


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this module does not implement (permanent)."""


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    """The parts of a Hugging Face config.json the Llama-family module needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    layer_sliding_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LlamaConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; "
                f"expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d['hidden_act']!r} unsupported; need silu")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        n_layers = int(d["num_hidden_layers"])
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = rope if rope_type not in (None, "default") else None
        window = d.get("sliding_window")
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
            if not d.get("use_sliding_window"):
                window = None
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        if model_type == "llama":
            window = None
        layer_types = d.get("layer_types") or ["sliding_attention" if window else "full"] * n_layers
        windows = tuple(
            int(window) if window and t == "sliding_attention" else None for t in layer_types
        )
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            layer_sliding_windows=windows,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies as Hugging Face computes them, with linear/llama3 scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


def _rotations(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[T, head_dim/2] complex64 rotations e^(i * position * inv_freq)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(freqs), freqs)


def interleave_rope_rows(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder a q/k projection's output rows per head from half-split to interleaved pairs."""
    rest = w.shape[1:]
    w = w.reshape(num_heads, 2, head_dim // 2, *rest).transpose(1, 2)
    return w.reshape(num_heads * head_dim, *rest)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.layer_idx = layer_idx
        windows = cfg.layer_sliding_windows
        self.sliding_window = windows[layer_idx] if layer_idx < len(windows) else None
        self.input_layernorm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.inter = cfg.intermediate_size
        self.compute_dtype = torch.float32  # set by LlamaForCausalLM.set_dtype

    def forward(
        self, h: torch.Tensor, rope: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        if meta.cpu_ops is not None:
            return self.forward_decode(h, rope, meta, kv_cache)
        if meta.bf16_ops is not None:
            return self.forward_bf16(h, rope, meta, kv_cache)
        # hot path, once per layer per step: linears are called through .forward (no
        # nn.Module hook dispatch), the residual stream h is updated in place (it is this
        # forward's own tensor), and each line is as few torch ops as it can be (~3-10 µs each)
        t = h.shape[0]
        q_size, qk_size = self.q_size, self.q_size + self.kv_size
        # the residual stream h and the norms stay fp32 (HF-like norm precision); matmul
        # inputs are cast to the compute dtype
        x = rms_norm(h, self.input_layernorm, self.eps, self.compute_dtype)
        qkv = self.qkv_proj.forward(x)
        lora = meta.lora
        if lora is not None:
            lora.add(self.layer_idx, "qkv_proj", x, qkv)
        # RoPE on q|k in fp32 (one complex multiply), written back into qkv with the cast
        qk = qkv[:, :qk_size]
        rot = torch.view_as_complex(qk.float().view(t, -1, self.head_dim // 2, 2)) * rope
        qk.copy_(torch.view_as_real(rot).view(t, qk_size))
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        attn = paged_attention(q, qkv[:, q_size:], kv_cache, meta, self.sliding_window)
        attn = attn.reshape(t, q_size)
        h = h.add_(self.o_proj.forward(attn))
        if lora is not None:
            lora.add(self.layer_idx, "o_proj", attn, h)
        x = rms_norm(h, self.post_attention_layernorm, self.eps, self.compute_dtype)
        gu = self.gate_up_proj.forward(x)
        if lora is not None:
            lora.add(self.layer_idx, "gate_up_proj", x, gu)
        act = F.silu(gu[:, : self.inter]).mul_(gu[:, self.inter :])
        h = h.add_(self.down_proj.forward(act))
        if lora is not None:
            lora.add(self.layer_idx, "down_proj", act, h)
        return h

    def forward_bf16(
        self, h: torch.Tensor, rope: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """`forward` of a bf16 model with the bf16 kernels: the norms, RoPE, SiLU*up and the
        residual adds are one kernel call each (torch takes 2-6 ops for each), with torch's
        roundings.
        `rope` is the whole rotation table as fp32 pairs [positions, head_dim/2, 2]."""
        ops = meta.bf16_ops
        assert ops is not None and meta.positions is not None
        t, q_size = h.shape[0], self.q_size
        lora = meta.lora
        x = ops.rms_norm_bf16(h, self.input_layernorm, self.eps)
        qkv = self.qkv_proj.forward(x)
        if lora is not None:
            lora.add(self.layer_idx, "qkv_proj", x, qkv)
        ops.rope_bf16_(qkv, self.num_heads + self.num_kv_heads, rope, meta.positions)
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        attn = paged_attention(q, qkv[:, q_size:], kv_cache, meta, self.sliding_window)
        attn = attn.reshape(t, q_size)
        o = self.o_proj.forward(attn)
        if lora is not None:
            lora.add(self.layer_idx, "o_proj", attn, o)
        h = ops.add_bf16_(h, o)
        x = ops.rms_norm_bf16(h, self.post_attention_layernorm, self.eps)
        gu = self.gate_up_proj.forward(x)
        if lora is not None:
            lora.add(self.layer_idx, "gate_up_proj", x, gu)
        act = ops.silu_mul_bf16(gu)
        down = self.down_proj.forward(act)
        if lora is not None:
            lora.add(self.layer_idx, "down_proj", act, down)
        return ops.add_bf16_(h, down)

    def forward_decode(
        self, h: torch.Tensor, rope: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """`forward` for a step of a few decoding requests on CPU, activations in fp32 (a
        bf16-computing model rounds the projection inputs to bf16 in the GEMV): the same math,
        each small op one fused kernel call (norm, RoPE, attention with the K|V write,
        SiLU*up) and the residual adds done by the projections where they can.
        `rope` is the whole rotation table as fp32 pairs [positions, head_dim/2, 2]."""
        ops = meta.cpu_ops
        assert ops is not None and meta.positions is not None
        assert meta.block_table is not None and meta.num_keys is not None
        lora = meta.lora
        x = ops.rms_norm(h, self.input_layernorm, self.eps)
        qkv = self.qkv_proj.forward(x)
        if lora is not None:
            lora.add(self.layer_idx, "qkv_proj", x, qkv)
        ops.rope_(qkv, self.num_heads + self.num_kv_heads, rope, meta.positions)
        attn = ops.attn_decode(
            qkv, self.num_heads, kv_cache, meta.slot_mapping, meta.block_table,
            meta.num_keys, self.sliding_window,
        )  # fmt: skip
        _add_projection(self.o_proj, attn, h)
        if lora is not None:
            lora.add(self.layer_idx, "o_proj", attn, h)
        x = ops.rms_norm(h, self.post_attention_layernorm, self.eps)
        gu = self.gate_up_proj.forward(x)
        if lora is not None:
            lora.add(self.layer_idx, "gate_up_proj", x, gu)
        act = ops.silu_mul(gu)
        _add_projection(self.down_proj, act, h)
        if lora is not None:
            lora.add(self.layer_idx, "down_proj", act, h)
        return h

    def kernel_weights(self) -> LayerWeights | None:
        """This layer as `CpuOps.decode_layers` reads it, or None when a projection has no
        kernel form (`kernel_weights()` of PackedLinear with a bf16 copy, or of Int8Linear
        on the int8 kernel)."""
        projs: list[ProjWeights] = []
        for proj in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
            weights = getattr(proj, "kernel_weights", lambda: None)()
            if weights is None:
                return None
            projs.append(weights)
        qkv, o, gate_up, down = projs
        return LayerWeights(
            self.input_layernorm.data, self.post_attention_layernorm.data,
            qkv, o, gate_up, down, self.sliding_window,
        )  # fmt: skip


def _add_projection(proj: nn.Module, x: torch.Tensor, h: torch.Tensor) -> None:
    """h += proj(x): in the projection's own kernel when it has one (PackedLinear.add_to)."""
    add_to = getattr(proj, "add_to", None)
    if add_to is not None:
        add_to(x, h)
    else:
        h.add_(proj.forward(x))


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`F.rms_norm(h, weight, eps).to(dtype)` in six torch ops instead of ~nine.

    torch's CPU rms_norm is composite (pow, sum, div, add, rsqrt, mul, mul); here the sum
    of squares is one vector_norm, scaled and offset by one addcmul. Equal to F.rms_norm up
    to float rounding (sqrt then square).
    """
    key = (eps, h.dtype, h.device)
    eps_t = _EPS.get(key)
    if eps_t is None:
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference
            eps_t = _EPS[key] = torch.tensor(eps, dtype=h.dtype, device=h.device)
    n = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    r = torch.addcmul(eps_t, n, n, value=1.0 / h.shape[-1]).rsqrt_()
    return (h * weight).mul_(r).to(dtype)


_EPS: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}  # eps as 0-dim tensors


class LlamaForCausalLM(nn.Module):
    """Flat-token Llama-family model: forward(input_ids[T], positions[T]) -> hidden[T, H]."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope_cache: torch.Tensor | None = None  # see cache_rope
        self.compute_dtype = torch.float32

    def rope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """Complex rotations for `positions`, shaped [T, 1, head_dim/2] (once per step).

        Read from the `cache_rope` table when there is one (one index_select instead of four
        ops; out-of-range positions raise), else computed.
        """
        cache = self._rope_cache
        if cache is not None:
            return cache.index_select(0, positions)[:, None, :]
        return _rotations(positions, self.inv_freq)[:, None, :]

    @property
    def has_rope_cache(self) -> bool:
        return self._rope_cache is not None

    def cache_rope(self, max_positions: int) -> None:
        """Precompute the rotations of positions [0, max_positions) (complex64, 8 B each).

        Call after the model has its final device and dtype; the runner does, with
        max_model_len. Identical values to computing them per step. Skipped (computed per
        step) when the table would pass 64 MiB.
        """
        if max_positions * (self.config.head_dim // 2) * 8 > 64 << 20:
            return
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        self._rope_cache = _rotations(positions, self.inv_freq)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """kv_caches: per layer `[num_blocks, block_size, 2, kv_heads, head_dim]` (K, V)."""
        h = self.embed_tokens.forward(input_ids).float()
        plan = meta.decode_plan
        if meta.cpu_ops is not None and plan is not None:
            assert meta.positions is not None and meta.slot_mapping is not None
            assert meta.block_table is not None and meta.num_keys is not None
            lora = None if meta.lora is None else meta.lora.kernel
            meta.cpu_ops.decode_layers(
                plan, h, meta.positions, meta.slot_mapping, meta.block_table, meta.num_keys, lora
            )
            return h
        if meta.cpu_ops is not None or meta.bf16_ops is not None:
            assert self._rope_cache is not None  # the runner fuses only with a table
            rope = torch.view_as_real(self._rope_cache)
        else:
            rope = self.rope_table(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer.forward(h, rope, meta, kv_cache)
        return h

    def plan_decode(
        self, ops: CpuOps, kv_caches: list[torch.Tensor], block_size: int
    ) -> DecodePlan | None:
        """The plan to run the layers of a fused decode step in one `ops.decode_layers`
        call (`AttentionMetadata.decode_plan`) over `kv_caches`, or None unless every
        projection has a kernel form and the RoPE table is cached."""
        decoders = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        layers = [layer.kernel_weights() for layer in decoders]
        kernel_layers = [lw for lw in layers if lw is not None]
        if self._rope_cache is None or not layers or len(kernel_layers) != len(self.layers):
            return None
        first = decoders[0]
        return ops.decode_plan(
            kernel_layers,
            heads=first.num_heads,
            kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            block_size=block_size,
            eps=first.eps,
            rope=torch.view_as_real(self._rope_cache),
            kv_caches=kv_caches,
        )

    def compute_logits(
        self, hidden: torch.Tensor, cpu_ops: CpuOps | None = None, fp32: bool = True
    ) -> torch.Tensor:
        """fp32 logits (in the compute dtype unless `fp32`). With `cpu_ops` (a fused decode
        step) the norm is one kernel call and the lm_head takes the fp32 activations (its
        bf16 kernel: no torch thread pool wakes up in a decode step, whose helpers would
        contend with the kernels' own)."""
        if cpu_ops is not None:
            return self.lm_head.forward(
                cpu_ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
            ).float()
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps, self.compute_dtype)
        logits = self.lm_head.forward(x)
        return logits.float() if fp32 else logits

    def set_dtype(self, dtype: torch.dtype) -> LlamaForCausalLM:
        """Weights in `dtype`; norm weights (and the residual stream) stay fp32."""
        self.to(dtype)
        self.compute_dtype = dtype
        self.norm.data = self.norm.data.float()
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.compute_dtype = dtype
            layer.input_layernorm.data = layer.input_layernorm.data.float()
            layer.post_attention_layernorm.data = layer.post_attention_layernorm.data.float()
        self.inv_freq = self.inv_freq.float()
        return self

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Copy Hugging Face named tensors in; return the names that are missing."""
        return load_hf_state(self, tensors)


def load_hf_state(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Map `model.layers.N.self_attn.q_proj.weight`-style names onto the fused layout."""
    cfg = model.config
    missing: list[str] = []

    def take(name: str) -> torch.Tensor | None:
        for key in (name, name.removeprefix("model.")):
            if key in tensors:
                return tensors[key]
        missing.append(name)
        return None

    def put(dst: torch.Tensor, *parts: torch.Tensor | None) -> None:
        if any(p is None for p in parts):
            return
        src = torch.cat([p for p in parts if p is not None], dim=0) if len(parts) > 1 else parts[0]
        assert src is not None
        if tuple(src.shape) != tuple(dst.shape):
            raise UnsupportedModelError(f"shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
        dst.data.copy_(src)

    with torch.no_grad():
        put(model.embed_tokens.weight, take("model.embed_tokens.weight"))
        put(model.norm, take("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            put(model.lm_head.weight, take("lm_head.weight"))
        hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            put(layer.input_layernorm, take(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm, take(p + "post_attention_layernorm.weight"))
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            if q is not None and k is not None:
                q, k = interleave_rope_rows(q, hq, d), interleave_rope_rows(k, hk, d)
            put(layer.qkv_proj.weight, q, k, v)
            if cfg.qkv_bias:
                qb, kb, vb = (take(p + f"self_attn.{n}_proj.bias") for n in "qkv")
                if qb is not None and kb is not None:
                    qb, kb = interleave_rope_rows(qb, hq, d), interleave_rope_rows(kb, hk, d)
                put(layer.qkv_proj.bias, qb, kb, vb)
            put(layer.o_proj.weight, take(p + "self_attn.o_proj.weight"))
            if cfg.o_bias:
                put(layer.o_proj.bias, take(p + "self_attn.o_proj.bias"))
            put(
                layer.gate_up_proj.weight,
                take(p + "mlp.gate_proj.weight"),
                take(p + "mlp.up_proj.weight"),
            )
            put(layer.down_proj.weight, take(p + "mlp.down_proj.weight"))
    return missing
