"""The torch thread backend's own promises beyond the backend contract (which
test_backend_contract.py runs on it): reference tokens, blocks returned, a submit that
never waits for a step, and the engine thread's nice value and cores."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.core.outputs import RunnerOutput, SchedulerOutput
from sluice.engine.engine_core import EngineCore
from sluice.engine.options import EngineOptions
from tests.unit.engine.backend_contract import collect, greedy
from tests.unit.engine.fakes import FakeRunner, reference_tokens
from tests.unit.engine.invariants import check_all_returned
from tests.waiting import wait_until_async

PROMPT = list(range(1, 19))


def make_backend(
    runner: FakeRunner | None = None, options: EngineOptions | None = None, **overrides: Any
) -> TorchEngineBackend:
    overrides.setdefault("max_model_len", 64)
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, **overrides)
    core = EngineCore(config, runner or FakeRunner(64, 4), hash_seed=0)
    return TorchEngineBackend(core, options=options)


def test_streams_carry_the_reference_tokens_and_every_block_comes_back() -> None:
    """What the contract (test_backend_contract.py) cannot say of every backend: the
    tokens are the runner's, and finished and aborted requests return all their blocks."""

    async def main() -> dict[str, list[EngineDelta]]:
        backend = make_backend(FakeRunner(64, 4, step_delay_s=0.005))
        backend.start()
        for i in range(6):
            backend.submit(EngineRequest(f"r{i}", PROMPT[: 5 + i], greedy(7)))
        backend.submit(EngineRequest("long", PROMPT, greedy(40)))

        async def abort_after_first(batch: list[EngineDelta]) -> None:
            if any(d.request_id == "long" and d.token_ids for d in batch):
                backend.abort("long")

        out = await collect(backend, {"long", *(f"r{i}" for i in range(6))}, abort_after_first)
        await wait_until_async(lambda: backend.stats().kv_usage == 0.0, what="blocks freed")
        check_all_returned(backend.core.scheduler)
        backend.shutdown()
        return out

    out = asyncio.run(main())
    for i in range(6):
        deltas = out[f"r{i}"]
        assert [t for d in deltas for t in d.token_ids] == reference_tokens(PROMPT[: 5 + i], 7)
        assert deltas[-1].finish_reason == "length"
    assert out["long"][-1].finish_reason == "abort"


class GatedRunner(FakeRunner):
    """Holds each step until `gate` is set; `entered` says a step has begun."""

    def __init__(self) -> None:
        super().__init__(64, 4)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.num_entered = 0

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.num_entered += 1
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().execute(scheduler_output)


def test_submit_does_not_wait_for_the_engine() -> None:
    """200 submits return while the engine is held inside a step."""

    async def main() -> None:
        runner = GatedRunner()
        backend = make_backend(runner)
        backend.start()
        backend.submit(EngineRequest("first", [1, 2, 3], greedy(1)))
        assert runner.entered.wait(10), "the engine did not start a step"
        submitter = threading.Thread(
            target=lambda: [
                backend.submit(EngineRequest(f"r{i}", [1, 2, 3], greedy(1))) for i in range(200)
            ]
        )
        submitter.start()
        submitter.join(10)  # a submit that waited for the engine would wait for the gate
        assert not submitter.is_alive(), "submit waited for the engine's step"
        assert runner.num_entered == 1  # still held in the first step
        runner.gate.set()
        await collect(backend, {"first", *(f"r{i}" for i in range(200))})
        backend.shutdown()

    asyncio.run(main())


def _probe_engine_thread(backend: TorchEngineBackend, probe: Callable[[int], Any]) -> Any:
    """Start the engine, run one request through it, and return `probe(native id of the
    engine thread)`, taken before the backend shuts down."""

    async def main() -> Any:
        backend.start()
        backend.submit(EngineRequest("a", PROMPT, greedy(2)))
        await collect(backend, {"a"})
        thread = backend._thread
        assert thread is not None and thread.native_id is not None
        try:
            return probe(thread.native_id)
        finally:
            backend.shutdown()

    return asyncio.run(main())


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice here")
def test_the_engine_thread_runs_at_its_nice_value_and_the_caller_keeps_its_own() -> None:
    assert make_backend().options.thread_nice == 10  # as `sluice` serves (EngineOptions)
    backend = make_backend(options=EngineOptions(thread_nice=7))
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # applied only without torch helper threads
    try:
        nice = _probe_engine_thread(backend, lambda tid: os.getpriority(os.PRIO_PROCESS, tid))
    finally:
        torch.set_num_threads(threads)
    # nice values only go up without privileges: the engine's is at least what it asked
    assert nice >= 7
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no cpu affinity here")
def test_the_engine_thread_runs_on_its_cores_and_the_caller_keeps_its_own() -> None:
    assert make_backend().options.cpus is None  # by default it runs wherever it started
    caller = os.sched_getaffinity(0)
    mine = frozenset([min(caller)])
    # as the composition root builds them (SLUICE_ENGINE_CPUS)
    backend = make_backend(options=EngineOptions(cpus=mine))
    assert _probe_engine_thread(backend, os.sched_getaffinity) == mine
    assert os.sched_getaffinity(0) == caller
