"""The built-in `tiny-llama` preset: writes a standard Hugging Face model directory on first use.

Called by `engine.loader.resolve_model_dir`. The directory holds config.json, seeded random
weights in model.safetensors (Hugging Face names), a byte-level BPE tokenizer.json trained
in-process on a fixed built-in text (deterministic), tokenizer_config.json, a ChatML
chat_template.jinja and generation_config.json, so the loader reads it exactly like a real
checkpoint. Config overrides (the benchmark's bigger model) get their own directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
A sluice is a water channel controlled at its head by a movable gate. Mill races, flumes and
spillways are kinds of sluices. Water flows through the gate when it opens, and the keeper
decides how much to let through, hour by hour, so the fields below get what they need and the
river above does not flood. In the same way a request enters a queue, waits its turn, and is
served when the engine has room. Tokens stream back one by one: the quick brown fox jumps over
the lazy dog; pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!
Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 42 and 7 percent.
Hello, world. Hello there! How are you today? I am fine, thank you. What is the weather like?
It is sunny, with a light breeze from the west, and the river is calm and clear this morning.
Users ask questions, assistants answer them; the system sets the rules of the conversation.
Engines batch requests, schedule tokens, cache prefixes in blocks, and sample the next word.
Unicode text appears as well: café, naïve, Zürich, São Paulo, Ελληνικά, Русский, 日本語, 中文.
"""


def preset_dir_name(overrides: dict[str, Any] | None) -> str:
    if not overrides:
        return "tiny-llama"
    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
    return f"tiny-llama-{digest}"


def ensure_tiny_llama(
    data_dir: Path, overrides: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """The preset's directory under `data_dir/models`, written atomically if absent."""
    target = data_dir / "models" / preset_dir_name(overrides)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        write_tiny_llama(tmp, overrides, seed)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; use its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE trained on the built-in corpus (same input, same merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return tok


def write_tiny_llama(path: Path, overrides: dict[str, Any] | None = None, seed: int = 0) -> None:
    """Write the preset's files into `path` (an existing, empty directory)."""
    config = {**TINY_LLAMA_CONFIG, **(overrides or {})}
    if "head_dim" not in (overrides or {}):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    tok = train_tokenizer(min(512, config["vocab_size"]))
    if tok.get_vocab_size() > config["vocab_size"]:
        raise ValueError(
            f"vocab_size {config['vocab_size']} < tokenizer size {tok.get_vocab_size()}"
        )
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": config["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3], "max_new_tokens": 256}, indent=2)
    )
    save_file(random_weights(config, seed), str(path / "model.safetensors"), {"format": "pt"})


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded N(0, 0.02) weights (norms at 1) under Hugging Face Llama names."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    out = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.ones(h)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h)
        out[p + "self_attn.q_proj.weight"] = w(hq * d, h)
        out[p + "self_attn.k_proj.weight"] = w(hkv * d, h)
        out[p + "self_attn.v_proj.weight"] = w(hkv * d, h)
        out[p + "self_attn.o_proj.weight"] = w(h, hq * d)
        out[p + "mlp.gate_proj.weight"] = w(inter, h)
        out[p + "mlp.up_proj.weight"] = w(inter, h)
        out[p + "mlp.down_proj.weight"] = w(h, inter)
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(v, h)
    return out
