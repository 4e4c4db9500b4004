"""A request outside the engine's limits fails alone: a seed no generator takes, a token
id the embedding does not hold. Checked at `submit` and again as the engine core adds
it; the requests beside it finish and the engine stays up (tiny-llama, CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.engine.backends.base import EngineDelta, EngineRequest, RequestRejectedError
from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.sampling import MAX_SEED, MIN_SEED, SamplingParams, SamplingParamsError

PROMPT = [1, 17, 42, 99, 7, 300, 12]
VOCAB = 512  # the tiny-llama preset's
CONFIG = EngineConfig(
    block_size=16, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256
)


def sampled(max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def with_seed(seed: int) -> SamplingParams:
    """Params carrying a seed their constructor would refuse (as if changed after)."""
    params = sampled(4)
    params.seed = seed
    return params


BAD_REQUESTS = {
    "seed-2**64": EngineRequest("bad", PROMPT, with_seed(2**64)),
    "seed-below-int64": EngineRequest("bad", PROMPT, with_seed(-(2**63) - 1)),
    "token-id-vocab": EngineRequest("bad", [*PROMPT, VOCAB], sampled(4)),
    "token-id-negative": EngineRequest("bad", [-1, *PROMPT], sampled(4)),
    "stop-token-id": EngineRequest(
        "bad", PROMPT, SamplingParams(max_tokens=4, stop_token_ids=[VOCAB + 7])
    ),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchEngineBackend]:
    data_dir = tmp_path_factory.mktemp("data")
    backend = TorchEngineBackend.from_model("tiny-llama", config=CONFIG, data_dir=data_dir)
    yield backend


async def run_until_done(
    backend: TorchEngineBackend | ProcessEngineBackend, want: set[str]
) -> dict[str, list[EngineDelta]]:
    got: dict[str, list[EngineDelta]] = {}
    done: set[str] = set()
    async with asyncio.timeout(60):
        async for batch in backend.deltas():
            for delta in batch:
                got.setdefault(delta.request_id, []).append(delta)
                if delta.finished:
                    done.add(delta.request_id)
            if done >= want:
                return got
    raise AssertionError(f"the delta stream ended before {want - done} finished")


def test_sampling_params_take_every_int64_and_uint64_seed() -> None:
    assert SamplingParams(seed=MIN_SEED).seed == -(2**63)
    assert SamplingParams(seed=MAX_SEED).seed == 2**64 - 1
    for seed in (MIN_SEED - 1, MAX_SEED + 1):
        with pytest.raises(SamplingParamsError, match="seed must be in"):
            SamplingParams(seed=seed)


def test_submit_rejects_what_an_engine_step_could_not_run(engine: TorchEngineBackend) -> None:
    assert engine.vocab_size == VOCAB
    for name, request in BAD_REQUESTS.items():
        with pytest.raises(RequestRejectedError) as info:
            engine.submit(request)
        assert ("seed" in str(info.value)) == name.startswith("seed"), name


def test_seeds_at_both_ends_of_the_range_run_beside_greedy_ones(
    engine: TorchEngineBackend,
) -> None:
    async def main() -> dict[str, list[EngineDelta]]:
        engine.start()
        engine.submit(EngineRequest("int64-min", PROMPT, sampled(6, MIN_SEED)))
        engine.submit(EngineRequest("minus-one", PROMPT, sampled(6, -1)))
        engine.submit(EngineRequest("uint64-max", PROMPT, sampled(6, MAX_SEED)))
        return await run_until_done(engine, {"int64-min", "minus-one", "uint64-max"})

    got = asyncio.run(main())
    try:
        for rid in ("int64-min", "minus-one", "uint64-max"):
            assert got[rid][-1].finish_reason == "length"
            assert got[rid][-1].num_output_tokens == 6
        # -1 is 2**64 - 1 as a generator seed (two's complement), the same draws
        assert [d.token_ids for d in got["minus-one"]] == [d.token_ids for d in got["uint64-max"]]
        assert engine.health()
    finally:
        engine.shutdown()


def add_unchecked(backend: TorchEngineBackend, request: EngineRequest) -> None:
    """What `submit` does past its checks: hand the request to the engine thread."""
    with backend._cond:
        backend._inbox.append(("add", request))
        backend._cond.notify()


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_a_request_past_submit_fails_alone_and_the_batch_goes_on(tmp_path: Path, name: str) -> None:
    """Even if a bad request got past `submit`, the engine core refuses it as it is added:
    it ends alone with 'error', the request beside it completes."""

    async def main() -> dict[str, list[EngineDelta]]:
        backend = TorchEngineBackend.from_model("tiny-llama", config=CONFIG, data_dir=tmp_path)
        backend.start()
        try:
            backend.submit(EngineRequest("good", PROMPT, sampled(8, seed=3)))
            add_unchecked(backend, BAD_REQUESTS[name])
            got = await run_until_done(backend, {"good", "bad"})
            assert backend.health()
            backend.submit(EngineRequest("after", PROMPT, sampled(3)))
            got.update(await run_until_done(backend, {"after"}))
            return got
        finally:
            backend.shutdown()

    got = asyncio.run(main())
    assert got["bad"][-1].finish_reason == "error"
    assert got["bad"][-1].error is not None and "must be" in got["bad"][-1].error
    assert [t for d in got["bad"] for t in d.token_ids] == []
    assert got["good"][-1].finish_reason == "length"
    assert got["good"][-1].num_output_tokens == 8
    assert got["after"][-1].finish_reason == "length"


@pytest.mark.slow  # starts an interpreter that imports torch
def test_the_engine_process_refuses_bad_requests_and_keeps_serving(tmp_path: Path) -> None:
    async def main() -> dict[str, list[EngineDelta]]:
        engine = ProcessEngineBackend(EngineSpec("tiny-llama", CONFIG, tmp_path))
        engine.start()
        try:
            assert engine.vocab_size == VOCAB
            for request in BAD_REQUESTS.values():
                with pytest.raises(RequestRejectedError):
                    engine.submit(request)
            engine.submit(EngineRequest("good", PROMPT, sampled(8, seed=-5)))
            engine.vocab_size = None  # the engine process checks again as it adds
            engine.submit(BAD_REQUESTS["token-id-vocab"])
            got = await run_until_done(engine, {"good", "bad"})
            assert engine.health()
            return got
        finally:
            await asyncio.to_thread(engine.shutdown, 10.0)

    got = asyncio.run(main())
    assert got["bad"][-1].finish_reason == "error"
    assert got["good"][-1].finish_reason == "length"
    assert got["good"][-1].num_output_tokens == 8
