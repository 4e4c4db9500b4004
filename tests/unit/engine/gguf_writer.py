"""Test helper: a Hugging Face Llama/Qwen2 directory written as a GGUF, as llama.cpp's
convert_hf_to_gguf.py writes it (its tensor names, q/k rows permuted for llama, byte-level
BPE tokenizer metadata), through `gguf.GGUFWriter`, with 2-D weights in a chosen type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from sluice.engine.preset import CHAT_TEMPLATE

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` (n_head: the q or the kv head count)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    hf_dir: Path,
    out: Path,
    arch: str = "llama",
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    overrides: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """`overrides`: by GGUF tensor name, data already in the file's layout (raw blocks of a
    quantized type, or F32 values) written instead of the HF directory's tensor."""
    config: dict[str, Any] = json.loads((hf_dir / "config.json").read_text())
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    w = GGUFWriter(out, arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _tokenizer(w, hf_dir)
    for name, array in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        data = array.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = llama_cpp_permute(data, n_head if "q_proj" in name else n_kv)
        kind = qtype if data.ndim == 2 else GGMLQuantizationType.F32
        if gguf_name(name) in (overrides or {}):
            raw, raw_kind = (overrides or {})[gguf_name(name)]
            f32 = raw_kind == GGMLQuantizationType.F32
            w.add_tensor(gguf_name(name), raw, raw_dtype=None if f32 else raw_kind)
        elif kind == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), data)
        elif kind == GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(data, kind), raw_dtype=kind)
    for name, (raw, kind) in (extra_tensors or {}).items():
        w.add_tensor(name, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tokenizer(w: GGUFWriter, hf_dir: Path) -> None:
    """tokenizer.json (the preset's byte-level BPE) as llama.cpp's gpt2 tokenizer keys."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [""] * (max([*vocab.values(), *added.values()]) + 1)
    for text, i in {**vocab, **added}.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in added else 1 for t in tokens])  # 3: control
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
