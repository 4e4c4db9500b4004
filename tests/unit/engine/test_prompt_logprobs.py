"""Prompt logprobs (`SamplingParams.prompt_logprobs`) on the tiny-llama preset at fp32.

Each prompt token's logprob, rank and top alternatives equal the log-softmax of a plain
full forward over the prompt (transformers' own model on the same directory), whether the
prompt is prefilled at once or in chunks, batched with other requests, or its prefix is
in the cache from an earlier request (which it must not use). They come once, on the
first delta that has a token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sluice.engine.backends.base import EngineDelta, EngineLogprob, EngineRequest
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.runner import model_runner
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.invariants import drive

transformers = pytest.importorskip("transformers")

TEXT = "Hello, world. How are you today? I am fine, thank you. The weather is nice."
OTHER = "Engines batch requests, schedule tokens"
TOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("tiny-llama", data_dir=tmp_path_factory.mktemp("data"), dtype="float32")


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> Any:
    """log_softmax(logits) at every position of `prompt`, from one full forward."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    hf.eval()

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return log_softmax


def make_core(loaded: LoadedModel, **overrides: Any) -> EngineCore:
    overrides.setdefault("num_kv_blocks", 64)
    overrides.setdefault("max_model_len", 128)
    overrides.setdefault("max_num_batched_tokens", 128)
    config = EngineConfig(block_size=4, dtype="float32", **overrides)
    return EngineCore(
        config,
        ModelRunner(loaded.model, config),
        eos_token_ids=loaded.eos_token_ids,
        detokenizers=tokenizer_detokenizers(loaded.tokenizer),
    )


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[EngineDelta]]:
    return drive(core, requests, max_steps=1000)


def params(prompt_logprobs: int | None = 3, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )


def prompt_logprobs_of(deltas: list[EngineDelta]) -> list[EngineLogprob | None]:
    """The one delta's prompt logprobs: the first, and no other delta has any."""
    assert deltas[0].token_ids
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    got = deltas[0].prompt_logprobs
    assert got is not None
    return got


def check(got: list[EngineLogprob | None], prompt: list[int], lp: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], lp[i - 1]  # position i - 1 predicts token i
        assert entry is not None and entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=TOL)
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        top_v, top_i = row.topk(k) if k else (row[:0], row[:0].long())
        assert [t for t, _ in entry.top_logprobs] == top_i.tolist()
        assert [v for _, v in entry.top_logprobs] == pytest.approx(top_v.tolist(), abs=TOL)


@pytest.mark.parametrize("budget", [128, 7, 4], ids=["whole", "chunks-of-7", "chunks-of-4"])
def test_prompt_logprobs_match_a_full_forward(
    loaded: LoadedModel, reference: Any, budget: int
) -> None:
    prompt = loaded.tokenizer.encode(TEXT)
    other = loaded.tokenizer.encode(OTHER)
    assert len(prompt) > 2 * budget or budget == 128
    core = make_core(loaded, max_num_batched_tokens=budget)
    out = run(
        core,
        [
            EngineRequest("p", prompt, params(3)),
            EngineRequest("other", other, params(None)),
            EngineRequest("zero", other, params(0)),
        ],
    )
    check(prompt_logprobs_of(out["p"]), prompt, reference(prompt), 3)
    check(prompt_logprobs_of(out["zero"]), other, reference(other), 0)
    assert all(d.prompt_logprobs is None for d in out["other"])
    # the output is what it is without prompt logprobs
    plain = run(make_core(loaded), [EngineRequest("p", prompt, params(None))])
    assert [t for d in out["p"] for t in d.token_ids] == [
        t for d in plain["p"] for t in d.token_ids
    ]


def test_a_cached_prefix_is_computed_again(loaded: LoadedModel, reference: Any) -> None:
    prompt = loaded.tokenizer.encode(TEXT)
    core = make_core(loaded)
    first = run(core, [EngineRequest("warm", prompt, params(None))])
    assert first["warm"][-1].num_cached_tokens == 0
    again = run(core, [EngineRequest("hit", prompt, params(None))])
    assert again["hit"][-1].num_cached_tokens > 0  # the prefix is in the cache
    out = run(core, [EngineRequest("p", prompt, params(2))])
    assert out["p"][-1].num_cached_tokens == 0
    check(prompt_logprobs_of(out["p"]), prompt, reference(prompt), 2)


def test_long_prompts_go_through_the_lm_head_in_slices(
    loaded: LoadedModel, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 5)
    prompt = loaded.tokenizer.encode(TEXT)
    out = run(make_core(loaded), [EngineRequest("p", prompt, params(1))])
    check(prompt_logprobs_of(out["p"]), prompt, reference(prompt), 1)


def test_a_one_token_prompt_has_only_the_first_none(loaded: LoadedModel) -> None:
    out = run(make_core(loaded), [EngineRequest("p", [5], params(2))])
    assert prompt_logprobs_of(out["p"]) == [None]
