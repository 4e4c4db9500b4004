"""Random by default: a request without a seed samples differently in every fresh engine.

Every engine used to seed its shared sampling generator with 0, so after each restart
the k-th unseeded request gave the same text. With a seed, output still reproduces
across engines (tiny-llama, CPU; its weights stay fixed by the preset's own seed).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice.engine.backends.base import EngineRequest
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 300, 12]
# 48 draws at temperature 1 over 512 tokens: two fresh engines agreeing is out of reach
MAX_TOKENS = 48


def generate_in_fresh_engine(data_dir: Path, seed: int | None) -> list[int]:
    """The tokens of one request in a newly built engine, the way the worker builds it."""
    config = EngineConfig(
        block_size=16, num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=128
    )
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed)

    async def main() -> list[int]:
        backend = TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=data_dir)
        backend.start()
        try:
            backend.submit(EngineRequest("r0", PROMPT, params))
            tokens: list[int] = []
            async with asyncio.timeout(60):
                async for batch in backend.deltas():
                    for delta in batch:
                        tokens.extend(delta.token_ids)
                        if delta.finished:
                            assert delta.finish_reason == "length"
                            return tokens
            raise AssertionError("the delta stream ended before the request finished")
        finally:
            backend.shutdown()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


def test_without_a_seed_two_fresh_engines_sample_differently(data_dir: Path) -> None:
    first = generate_in_fresh_engine(data_dir, seed=None)
    second = generate_in_fresh_engine(data_dir, seed=None)
    assert len(first) == len(second) == MAX_TOKENS
    assert first != second


def test_with_a_seed_two_fresh_engines_sample_alike(data_dir: Path) -> None:
    first = generate_in_fresh_engine(data_dir, seed=1234)
    second = generate_in_fresh_engine(data_dir, seed=1234)
    assert len(first) == MAX_TOKENS
    assert first == second
