"""The runner under the real EngineCore: greedy tokens equal HF `generate` with continuous
batching, chunked prefill (tiny token budget), prefix-cache hits and forced preemption."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.backends.base import EngineRequest
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.options import EngineOptions
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.runner_driver import save_hf_model
from tests.unit.engine.test_model_hf_equivalence import NEW_TOKENS, _hf_greedy, _hf_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

PROMPTS = [[0, *range(5 + i, 40 + 3 * i)] for i in range(4)]  # shared-ish prefixes
SHARED = [[0, *range(10, 42), 7], [0, *range(10, 42), 9]]  # 33 shared tokens


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, dict[str, list[int]]]:
    torch.set_num_threads(2)
    hf = _hf_model("mistral-window")
    path = save_hf_model(hf, tmp_path_factory.mktemp("core"))
    expected = {str(p): _hf_greedy(hf, p) for p in PROMPTS + SHARED}
    return load_model(path, dtype="float32"), expected


def _generate(
    lm: LoadedModel, prompts: list[list[int]], options: EngineOptions | None = None, **cfg: object
) -> tuple[list[list[int]], int]:
    config = EngineConfig(dtype="float32", block_size=4, max_model_len=128, **cfg)  # type: ignore[arg-type]
    core = EngineCore(
        config,
        ModelRunner(lm.model, config, options),
        eos_token_ids=lm.eos_token_ids,
        detokenizers=tokenizer_detokenizers(lm.tokenizer),
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", p, params))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id].extend(d.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))], core.scheduler.num_preemptions


def test_continuous_batching_with_chunked_prefill(
    case: tuple[LoadedModel, dict[str, list[int]]],
) -> None:
    lm, expected = case
    got, _ = _generate(lm, PROMPTS, num_kv_blocks=128, max_num_batched_tokens=10)
    assert got == [expected[str(p)] for p in PROMPTS]


def test_prefill_threads_take_the_long_steps_only(
    case: tuple[LoadedModel, dict[str, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    lm, expected = case
    calls: list[int] = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), set_threads(n)))
    set_threads(1)
    try:
        options = EngineOptions(prefill_threads=2, prefill_min_tokens=20)
        got, _ = _generate(lm, PROMPTS, options, num_kv_blocks=128)
    finally:
        set_threads(2)
    assert got == [expected[str(p)] for p in PROMPTS]
    # the first step prefills every prompt (>= 20 tokens), then 4 decodes a step
    assert calls == [2, 1]


def test_prefix_cache_hit_gives_same_tokens(
    case: tuple[LoadedModel, dict[str, list[int]]],
) -> None:
    lm, expected = case
    config = EngineConfig(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    core = EngineCore(config, ModelRunner(lm.model, config), eos_token_ids=lm.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for rid, prompt in zip(("a", "b"), SHARED, strict=True):
        core.add_request(EngineRequest(rid, prompt, params))
        tokens: list[int] = []
        cached = 0
        while core.has_unfinished():
            for d in core.step():
                tokens.extend(d.token_ids)
                if d.finish_reason is not None:
                    cached = d.num_cached_tokens or 0
        assert tokens == expected[str(prompt)]
    assert cached >= 32  # the second request reused the first one's full blocks


def test_preemption_by_recompute_gives_same_tokens(
    case: tuple[LoadedModel, dict[str, list[int]]],
) -> None:
    lm, expected = case
    got, preemptions = _generate(lm, PROMPTS, num_kv_blocks=30, enable_prefix_caching=False)
    assert preemptions > 0
    assert got == [expected[str(p)] for p in PROMPTS]
