"""Test helpers: random PEFT LoRA adapters saved beside a Hugging Face model directory.

PEFT initialises B at zero (an adapter that changes nothing); these draw A and B at
random so every adapter changes the greedy output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    std: float = 0.05,
    **lora_kwargs: Any,
) -> Path:
    """A LoRA adapter for the model in `model_dir`, every A and B random (seeded), saved
    with `save_pretrained` (adapter_config.json + adapter_model.safetensors)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        **lora_kwargs,
    )
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], new_tokens: int, merged: bool
) -> list[int]:
    """HF + PEFT greedy tokens for `prompt`: the adapter unmerged (PeftModel), or merged
    into the weights (`merge_and_unload`); the base model alone when no adapter."""
    import peft
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]
