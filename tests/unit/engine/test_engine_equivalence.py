"""The whole engine on the tiny-llama preset at fp32: scheduling never changes the output.

Greedy tokens are equal with chunked prefill on and off, prefix caching on and off (the
second request reports cached tokens), under forced preemption and for any batch mix;
seeded sampling reproduces; an abort mid-stream frees every block. Equality with HF
transformers itself is tested by the runner's own tests (test_model_hf_equivalence.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.invariants import check_all_returned

TEXTS = [
    "Hello, world. How are you today? I am fine, thank you.",
    "Hello, world. How are you today? What is the weather like?",
    "Engines batch requests, schedule tokens",
    "the quick brown fox",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("tiny-llama", data_dir=tmp_path_factory.mktemp("data"), dtype="float32")


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def make_core(loaded: LoadedModel, **overrides: Any) -> EngineCore:
    overrides.setdefault("num_kv_blocks", 64)
    overrides.setdefault("max_model_len", 128)
    overrides.setdefault("max_num_batched_tokens", 128)
    config = EngineConfig(block_size=4, dtype="float32", **overrides)
    runner = ModelRunner(loaded.model, config)
    return EngineCore(
        config,
        runner,
        eos_token_ids=loaded.eos_token_ids,
        detokenizers=tokenizer_detokenizers(loaded.tokenizer),
    )


def run(core: EngineCore) -> dict[str, list[EngineDelta]]:
    out: dict[str, list[EngineDelta]] = {}
    for _ in range(1000):
        if not core.has_unfinished():
            break
        for delta in core.step():
            out.setdefault(delta.request_id, []).append(delta)
    assert not core.has_unfinished()
    check_all_returned(core.scheduler)
    return out


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: SamplingParams | None = None,
    one_at_a_time: bool = False,
    **overrides: Any,
) -> tuple[dict[str, tuple[list[int], str]], EngineCore]:
    core = make_core(loaded, **overrides)
    out: dict[str, list[EngineDelta]] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", prompt, params or greedy()))
        if one_at_a_time:
            out |= run(core)
    out |= run(core)
    result = {
        rid: ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds))
        for rid, ds in out.items()
    }
    return result, core


@pytest.fixture(scope="module")
def baseline(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, tuple[list[int], str]]:
    result, _ = generate(loaded, prompts, one_at_a_time=True, enable_prefix_caching=False)
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in result.values())
    return result


def test_batched_equals_one_at_a_time(
    loaded: LoadedModel, prompts: list[list[int]], baseline: dict[str, Any]
) -> None:
    result, _ = generate(loaded, prompts, enable_prefix_caching=False)
    assert result == baseline


def test_chunked_prefill_equals_whole_prefill(
    loaded: LoadedModel, prompts: list[list[int]], baseline: dict[str, Any]
) -> None:
    chunked, _ = generate(loaded, prompts, max_num_batched_tokens=7)
    whole, _ = generate(loaded, prompts, enable_chunked_prefill=False, max_num_batched_tokens=128)
    assert chunked == whole == baseline


def test_prefix_caching_hits_and_changes_nothing(
    loaded: LoadedModel, prompts: list[list[int]], baseline: dict[str, Any]
) -> None:
    result, core = generate(loaded, prompts, one_at_a_time=True)
    assert result == baseline
    assert core.stats().num_cached_tokens > 0
    core.add_request(EngineRequest("again", prompts[0], greedy()))
    out = run(core)["again"]
    assert out[-1].num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4
    assert [t for d in out for t in d.token_ids] == baseline["r0"][0]


def test_forced_preemption_changes_nothing(
    loaded: LoadedModel, prompts: list[list[int]], baseline: dict[str, Any]
) -> None:
    needed = max(-(-(len(p) + MAX_TOKENS) // 4) for p in prompts)
    result, core = generate(loaded, prompts, num_kv_blocks=needed + 3)
    assert core.scheduler.num_preemptions > 0
    assert result == baseline


def test_seeded_sampling_reproduces_across_runs_and_batch_mix(
    loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS)
    first, _ = generate(loaded, prompts, params)
    again, _ = generate(loaded, prompts, params, max_num_batched_tokens=7)
    alone, _ = generate(loaded, prompts[:1], params)
    assert first == again
    assert alone["r0"] == first["r0"]
    other_seed, _ = generate(loaded, prompts[:1], SamplingParams(seed=99, max_tokens=MAX_TOKENS))
    assert other_seed["r0"] != first["r0"]


def test_backend_abort_mid_stream_frees_every_block(
    loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    core = make_core(loaded)
    backend = TorchEngineBackend(core, tokenizer=loaded.tokenizer)

    async def main() -> list[EngineDelta]:
        backend.start()
        backend.submit(
            EngineRequest("a", prompts[0], SamplingParams(max_tokens=100, ignore_eos=True))
        )
        seen: list[EngineDelta] = []
        async with asyncio.timeout(60):
            async for batch in backend.deltas():
                seen.extend(batch)
                if len(seen) == 2:
                    backend.abort("a")
                if seen[-1].finished:
                    break
        backend.shutdown()
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finish_reason == "abort"
    assert sum(d.finished for d in seen) == 1
    assert 2 <= seen[-1].num_output_tokens < 100  # type: ignore[operator]
    check_all_returned(core.scheduler)


def test_logprobs_come_with_each_token_when_asked(
    loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    core = make_core(loaded)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    core.add_request(EngineRequest("lp", prompts[2], params))
    core.add_request(EngineRequest("plain", prompts[2], greedy()))
    out = run(core)
    assert all(d.logprobs is None for d in out["plain"])
    for delta in out["lp"]:
        assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids) == 1
        entry = delta.logprobs[0]
        assert entry.token_id == delta.token_ids[0] and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0][0] == entry.token_id
