"""GGUF checkpoints (llama.cpp's single-file format) read for the engine, without torch.

Called by `engine.loader` (weights) and `engine.model_files` (config and tokenizer, also
in the gateway). The file is read through `gguf.GGUFReader`, llama.cpp's own Python
reader (a memory map). Its metadata becomes a Hugging Face config.json-shaped dict, so
`LlamaConfig.from_hf` validates both kinds of checkpoint alike; its tokenizer metadata a
`tokenizers.Tokenizer` (`engine.gguf_tokenizer`); its tensors float32 arrays under
Hugging Face names (`gguf.quants.dequantize`), with the q/k row permutation that
llama.cpp's converter applies to llama-architecture models undone. Everything the engine
cannot run (an architecture, a tensor type, a tensor it has no place for) is refused
when the file is opened, with one line that names it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from sluice.engine.gguf_tokenizer import GGUFTokenizerError, TokenizerMetadata, build_tokenizer
from sluice.engine.tokenizer import Tokenizer

# `general.architecture` -> Hugging Face model_type (the engine's Llama family)
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# llama.cpp permutes q/k rows for these (its rotary pairs are adjacent); qwen2 it leaves
_PERMUTED_QK = {"llama", "mistral"}
_Q = GGMLQuantizationType
TENSOR_TYPES = (
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rope scaling, as per-frequency divisors


class GGUFError(ValueError):
    """The file is not a GGUF the engine can run; the message is one line naming why."""


def find_gguf(path: Path) -> Path | None:
    """`path` if it is a .gguf file; the one .gguf in a directory without config.json;
    else None (a Hugging Face directory)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise GGUFError(f"{path} holds {len(files)} .gguf files ({names}); pass one of them")
    return files[0] if files else None


class GGUFCheckpoint:
    """One opened GGUF file: `hf_config()`, `tokenizer()`, `tensors()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._reader = GGUFReader(path)
        except Exception as e:  # a truncated or foreign file fails anywhere in the parse
            raise GGUFError(f"{path}: not a readable GGUF file ({e})") from e
        arch = self.value("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"{path.name}: architecture {arch!r} is not supported; the engine runs "
                f"{', '.join(ARCHITECTURES)}"
            )
        self.architecture: str = arch
        if int(self.value("split.count", 1)) > 1:
            raise GGUFError(
                f"{path.name} is one part of a split GGUF; merge the parts first "
                "(llama-gguf-split --merge)"
            )
        for t in self._reader.tensors:
            if t.tensor_type not in TENSOR_TYPES:
                raise GGUFError(
                    f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, which the "
                    f"engine cannot de-quantize; supported: "
                    f"{', '.join(q.name for q in TENSOR_TYPES)}"
                )
        self._names = {t.name: self._hf_name(t.name) for t in self._reader.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> int:
        value = self._arch(key)
        if value is None:
            raise GGUFError(f"{self.path.name} lacks {self.architecture}.{key}")
        return int(value)

    def _hf_name(self, name: str) -> str | None:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        if name == ROPE_FREQS:
            return None
        m = _LAYER.fullmatch(name)
        if m and m.group(2) in _LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        raise GGUFError(
            f"{self.path.name}: tensor {name} has no place in the engine's "
            f"{self.architecture} model"
        )

    def hf_config(self) -> dict[str, Any]:
        """The file's hyper-parameters under Hugging Face config.json names."""
        n_heads = self._required("attention.head_count")
        hidden = self._required("embedding_length")
        head_dim = int(self._arch("attention.key_length", hidden // n_heads))
        rotary = int(self._arch("rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise GGUFError(
                f"{self.path.name}: partial rotary embeddings ({rotary} of {head_dim} "
                "dimensions) are not supported"
            )
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size") or (len(tokens.data) if tokens else None)
        if vocab is None:
            vocab = self._tensor("token_embd.weight").shape[-1]
        config: dict[str, Any] = {
            "model_type": ARCHITECTURES[self.architecture],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._required("feed_forward_length"),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", n_heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._names,
            "attention_bias": "blk.0.attn_q.bias" in self._names,
            "hidden_act": "silu",
        }
        scaling = self._arch("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise GGUFError(f"{self.path.name}: rope scaling {scaling!r} is not supported")
            factor = self._arch("rope.scaling.factor") or self._arch("rope.scale_linear")
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        return config

    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer from `tokenizer.ggml.*` and `tokenizer.chat_template`."""
        model = self.value("tokenizer.ggml.model")
        tokens = self.value("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise GGUFError(f"{self.path.name} has no tokenizer (tokenizer.ggml.* metadata)")
        meta = TokenizerMetadata(
            model=model,
            tokens=tokens,
            token_types=self.value("tokenizer.ggml.token_type", ()),
            merges=self.value("tokenizer.ggml.merges", ()),
            scores=self.value("tokenizer.ggml.scores", ()),
            pre=self.value("tokenizer.ggml.pre"),
            bos_token_id=self.value("tokenizer.ggml.bos_token_id"),
            unk_token_id=self.value("tokenizer.ggml.unknown_token_id"),
            add_bos_token=self.value("tokenizer.ggml.add_bos_token"),
            add_space_prefix=self.value("tokenizer.ggml.add_space_prefix"),
        )
        try:
            hf = build_tokenizer(meta)
        except GGUFTokenizerError as e:
            raise GGUFError(f"{self.path.name}: {e}") from e

        def text(key: str) -> str | None:
            i = self.value(f"tokenizer.ggml.{key}")
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        return Tokenizer(
            hf,
            bos_token=text("bos_token_id"),
            eos_token=text("eos_token_id"),
            chat_template=self.value("tokenizer.chat_template"),
            extra_eos_token_ids=self.eos_token_ids,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End of generation: eos, and the end-of-turn/message tokens when the file names them."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = (self.value(f"tokenizer.ggml.{k}") for k in keys)
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    @property
    def bos_token_id(self) -> int | None:
        bos = self.value("tokenizer.ggml.bos_token_id")
        return None if bos is None else int(bos)

    def _tensor(self, name: str) -> ReaderTensor:
        for t in self._reader.tensors:
            if t.name == name:
                return t
        raise GGUFError(f"{self.path.name} has no tensor {name}")

    def rope_freqs(self) -> np.ndarray | None:
        """Llama 3.1-style frequency divisors, when the file carries them."""
        if ROPE_FREQS not in self._names:
            return None
        t = self._tensor(ROPE_FREQS)
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    def _hf_tensors(self) -> Iterator[tuple[ReaderTensor, str, int | None]]:
        """Each tensor with its Hugging Face name and, for a q/k projection stored in
        llama.cpp's permuted row order, the head count that `unpermute_qk` undoes it with."""
        cfg = self.hf_config()
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        permuted = self.architecture in _PERMUTED_QK
        for t in self._reader.tensors:
            name = self._names[t.name]
            if name is None:
                continue
            role = name.split(".")[-2]  # model.layers.N.self_attn.q_proj.weight -> q_proj
            yield t, name, heads.get(role) if permuted else None

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array in its Hugging Face layout), one at a time."""
        for t, name, num_heads in self._hf_tensors():
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if not array.flags.writeable:  # an F32 tensor is a view of the memory map
                array = array.copy()
            yield name, array if num_heads is None else unpermute_qk(array, num_heads)

    def quantized_blocks(
        self, kinds: Collection[GGMLQuantizationType]
    ) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
        """The 2-D tensors of `kinds` as their raw blocks (uint8 [rows, bytes], a view of
        the memory map), by Hugging Face name, q/k rows unpermuted as in `tensors`."""
        out: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
        for t, name, num_heads in self._hf_tensors():
            if t.tensor_type not in kinds or t.data.ndim != 2:
                continue
            raw = t.data if num_heads is None else unpermute_qk(t.data, num_heads)
            out[name] = (raw, t.tensor_type)
        return out


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf.py's `LlamaModel.permute`):
    per head, rows in adjacent rotary pairs back to Hugging Face's two halves."""
    rest = w.shape[1:]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)
