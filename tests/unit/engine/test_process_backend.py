"""The engine in a process of its own (tiny-llama, CPU): the same tokens as the threaded
backend, aborts, pinning, shutdown, and a kill -9 of the engine process."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sluice.engine.backends.base import (
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    RequestRejectedError,
)
from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.options import EngineOptions
from sluice.engine.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 300, 12]
CONFIG = EngineConfig(
    block_size=16, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256
)

pytestmark = pytest.mark.slow  # each test starts an interpreter that imports torch


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def with_prompt_logprobs(params: SamplingParams) -> SamplingParams:
    params.prompt_logprobs = 2
    return params


async def until_terminal(
    stream: AsyncIterator[list[EngineDelta]],
    want: set[str],
    seen: dict[str, list[EngineDelta]],
    on_tokens: Callable[[EngineDelta], None] | None = None,
) -> None:
    """Read `stream` until each of `want` has ended."""
    done: set[str] = set()
    async with asyncio.timeout(60):
        async for batch in stream:
            for delta in batch:
                seen.setdefault(delta.request_id, []).append(delta)
                if delta.finished:
                    done.add(delta.request_id)
                elif on_tokens is not None and delta.token_ids:
                    on_tokens(delta)
            if done >= want:
                return


def tokens(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_the_engine_process_streams_what_the_thread_does_aborts_and_shuts_down(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        thread = TorchEngineBackend.from_model("tiny-llama", config=CONFIG, data_dir=tmp_path)
        thread.start()
        ref: dict[str, list[EngineDelta]] = {}
        thread.submit(EngineRequest("ref", PROMPT, with_prompt_logprobs(greedy(24))))
        await until_terminal(thread.deltas(), {"ref"}, ref)
        thread.shutdown()

        cpus = sorted(os.sched_getaffinity(0))
        options = EngineOptions(cpus=frozenset(cpus[-1:]))
        engine = ProcessEngineBackend(EngineSpec("tiny-llama", CONFIG, tmp_path, options=options))
        engine.start()
        assert engine.health() and engine.config.max_model_len == 256
        assert os.sched_getaffinity(engine._process.pid) == {cpus[-1]}
        os.kill(engine._process.pid, signal.SIGINT)  # Ctrl-C: the parent decides when to stop
        with pytest.raises(RequestRejectedError):  # checked here, as the thread's is
            engine.submit(EngineRequest("long-prompt", list(range(1, 300)), greedy(4)))
        stream = engine.deltas()
        got: dict[str, list[EngineDelta]] = {}
        engine.submit(EngineRequest("a", PROMPT, with_prompt_logprobs(greedy(24))))
        engine.submit(EngineRequest("cut", PROMPT, greedy(200)))
        await until_terminal(stream, {"a", "cut"}, got, lambda d: engine.abort("cut"))
        assert tokens(got["a"]) == tokens(ref["ref"]) and got["a"][-1].finish_reason == "length"
        assert got["a"][-1].num_output_tokens == 24
        # the prompt logprobs cross the process boundary on the first delta
        want, have = ref["ref"][0].prompt_logprobs or [], got["a"][0].prompt_logprobs or []
        assert have[0] is None and [e.token_id for e in have[1:] if e] == PROMPT[1:]
        assert [e.logprob for e in have if e] == pytest.approx(
            [e.logprob for e in want if e], abs=1e-4
        )
        assert got["cut"][-1].finish_reason == "abort"
        assert len(tokens(got["cut"])) < 200
        assert engine.stats().num_generated_tokens >= 24

        engine.submit(EngineRequest("left", PROMPT, greedy(200)))
        assert [d.request_id for d in await anext(stream)] == ["left"]  # it is running
        await asyncio.to_thread(engine.shutdown, 10.0)
        rest = [delta async for batch in stream for delta in batch]  # ends after shutdown
        assert [d.finish_reason for d in rest if d.request_id == "left"][-1] == "abort"
        assert not engine.health()
        with pytest.raises(EngineDeadError):
            engine.submit(EngineRequest("late", PROMPT, greedy(4)))

    asyncio.run(main())


def test_a_killed_engine_process_ends_its_requests_with_error(tmp_path: Path) -> None:
    async def main() -> None:
        engine = ProcessEngineBackend(EngineSpec("tiny-llama", CONFIG, tmp_path))
        engine.start()
        stream = engine.deltas()
        got: dict[str, list[EngineDelta]] = {}
        engine.submit(EngineRequest("a", PROMPT, greedy(200)))
        engine.submit(EngineRequest("b", PROMPT, greedy(200)))
        pid = engine._process.pid
        killed: list[int] = []

        def kill(_delta: EngineDelta) -> None:
            if not killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        await until_terminal(stream, {"a", "b"}, got, kill)
        for rid in ("a", "b"):
            assert got[rid][-1].finish_reason == "error"
            assert len(tokens(got[rid])) < 200
        assert [b async for b in stream] == []  # the stream has ended
        assert not engine.health()
        assert "exited with code -9" in (engine.error or "")
        with pytest.raises(EngineDeadError):
            engine.submit(EngineRequest("late", PROMPT, greedy(4)))
        engine.shutdown(1.0)

    asyncio.run(main())


def test_an_engine_that_cannot_load_fails_start_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        engine = ProcessEngineBackend(EngineSpec(tmp_path / "no-such-model", CONFIG))
        with pytest.raises(EngineDeadError, match="failed to start"):
            engine.start()
        assert not engine._process.is_alive() and not engine.health()
        assert [b async for b in engine.deltas()] == []  # the stream has ended

    asyncio.run(main())
