"""Greedy tokens from our loader + runner equal HF transformers `generate` on the same weights.

Tiny random Llama, Qwen2 (qkv bias) and Mistral (sliding window shorter than the sequence)
models are saved with `save_pretrained`, loaded through `engine.loader`, and run at fp32:
single requests, a batch of unequal prompts, and chunked prefill.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.loader import load_model
from sluice.engine.runner.model_runner import ModelRunner
from tests.unit.engine.runner_driver import run_greedy, save_hf_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

BASE: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.25,
    bos_token_id=0,
    eos_token_id=1,
)

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
}

NEW_TOKENS = 12


def _hf_model(family: str) -> Any:
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**BASE, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    model.generation_config.eos_token_id = None  # (min_new_tokens would mask EOS logits)
    if family == "qwen2":  # HF inits biases at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    return model


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (5, 17, 11)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelRunner, list[list[int]]]:
    torch.set_num_threads(2)
    model = _hf_model(request.param)
    path = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    expected = [_hf_greedy(model, p) for p in _prompts()]
    loaded = load_model(path, dtype="float32")
    runner = ModelRunner(loaded.model, EngineConfig(num_kv_blocks=32, block_size=4))
    return runner, expected


def test_single_requests_match_hf(family_case: tuple[ModelRunner, list[list[int]]]) -> None:
    runner, expected = family_case
    for prompt, want in zip(_prompts(), expected, strict=True):
        assert run_greedy(runner, [prompt], NEW_TOKENS) == [want]


def test_batched_unequal_prompts_match_hf(
    family_case: tuple[ModelRunner, list[list[int]]],
) -> None:
    runner, expected = family_case
    assert run_greedy(runner, _prompts(), NEW_TOKENS) == expected


def test_chunked_prefill_matches_hf(family_case: tuple[ModelRunner, list[list[int]]]) -> None:
    runner, expected = family_case
    assert run_greedy(runner, _prompts(), NEW_TOKENS, chunk=3) == expected


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model = _hf_model("llama")
    path = save_hf_model(model, tmp_path / "sharded", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    loaded = load_model(path, dtype="float32")
    runner = ModelRunner(loaded.model, EngineConfig(num_kv_blocks=16, block_size=4))
    prompt = _prompts()[0]
    assert run_greedy(runner, [prompt], NEW_TOKENS) == [_hf_greedy(model, prompt)]
