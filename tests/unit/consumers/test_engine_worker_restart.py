"""A self-healing engine worker: its engine process is killed (kill -9) mid-generation, the
worker restarts it, and every request it held resumes from its progress with a new
attempt. The client (under the gateway's rules: fence by attempt, dedupe by absolute
offsets) sees exactly the uninterrupted greedy output; the usage records bill exactly
what it received; the worker is not ready during the outage and ready after."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import ENGINE_UNAVAILABLE, GenerateRequest, SamplingSpec
from sluice.consumers.engine_worker import EngineWorkerConfig, RestartBackoff
from sluice.consumers.progress import MemoryProgressStore
from sluice.engine.backends.base import EngineDeadError, EngineDelta
from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
from sluice.engine.config import EngineConfig
from tests.unit.consumers.engine_fakes import FakeEngineBackend, greedy_tokens
from tests.unit.consumers.engine_harness import (
    Client,
    WorkerThread,
    assert_billed_as_shown,
    create_topics,
    make_request,
)

PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [5, 6, 7, 8], [400, 3, 2], [9, 9, 9, 9, 9, 11]]
MAX_TOKENS = 200
CONFIG = EngineConfig(
    block_size=16, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=256
)


def request(request_id: str, prompt: list[int]) -> GenerateRequest:
    spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return make_request(request_id, prompt=prompt, max_tokens=MAX_TOKENS).model_copy(
        update={"sampling": spec}
    )


class RestartableFakeBackend(FakeEngineBackend):
    """The fake engine as `ProcessEngineBackend` behaves around a death: `crash()` ends
    what it holds with a retryable 'error' and ends `deltas()`; `restart()` (from any
    thread) starts a fresh one, failing the first `failed_starts` times."""

    def __init__(self, failed_starts: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failed_starts = failed_starts
        self.num_restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        super().start()

    def crash(self) -> None:
        """From the test's thread, as a kill -9 would."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._crash)

    def _crash(self) -> None:
        live = [x.request.request_id for x in [*self._waiting, *self._running]]
        live += [r.request_id for r in self._pending]
        self._waiting, self._running, self._pending = [], [], []
        self._dead = True  # the loop ends the stream after this batch
        error = "fake engine killed"
        batch = [EngineDelta(r, finish_reason="error", error=error, retryable=True) for r in live]
        if batch and self._queue is not None:
            self._queue.put_nowait(batch)

    def restart(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._stopping:
            raise EngineDeadError("shut down")
        if self.failed_starts:
            self.failed_starts -= 1
            raise EngineDeadError("fake engine failed to start")
        assert loop is not None
        self.num_restarts += 1
        self._queue = asyncio.Queue()
        self._dead = False
        asyncio.run_coroutine_threadsafe(self._run(), loop)


def fast_restarts(**overrides: Any) -> EngineWorkerConfig:
    overrides.setdefault("engine_restart_initial_s", 0.05)
    return EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01, **overrides)


def test_requests_the_engine_died_under_resume_on_the_restarted_engine() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    engine = RestartableFakeBackend(step_s=0.005)
    worker = WorkerThread(bus, engine, fast_restarts(engine_restart_initial_s=0.3)).start()
    stats = worker.worker.stats
    requests = [make_request(f"r{i}", prompt=[i + 1, 7], max_tokens=60) for i in range(3)]
    client.send(*requests)
    client.wait(
        lambda: all(
            len(client.view.streams.get(r.request_id, _NONE).token_ids) >= 10 for r in requests
        ),
        10,
        "for tokens",
    )
    engine.crash()
    client.wait(lambda: not stats.ready, 5, "for the worker to say it is not ready")
    assert stats.healthy and not stats.engine_up and worker.worker.health()
    client.cancel("r2")  # answered while the engine is down
    client.wait_finished(["r0", "r1", "r2"])
    client.wait(lambda: stats.ready, 5, "for the worker to be ready again")
    assert stats.engine_restarts == 1 == engine.num_restarts
    worker.stop()
    client.pump()

    for r in requests[:2]:
        stream = client.view.streams[r.request_id]
        assert stream.token_ids == greedy_tokens(r.prompt_token_ids, 60)
        assert stream.finish_reason == "length" and stream.num_terminal == 1
        assert stream.attempt == 1
        resumed = [s for s in engine.submitted if s.request_id == r.request_id][-1]
        assert resumed.num_resumed_tokens >= 10  # it went on from its progress
        usage = sorted(
            (u.attempt, u.completion_tokens, u.estimated)
            for u in client.usage
            if u.request_id == r.request_id
        )
        assert usage == [
            (0, resumed.num_resumed_tokens, True),
            (1, 60 - resumed.num_resumed_tokens, False),
        ]
        assert_billed_as_shown(client, r.request_id, len(r.prompt_token_ids))
    cancelled = client.view.streams["r2"]
    assert cancelled.finish_reason == "abort" and cancelled.num_terminal == 1
    assert "r2" not in {s.request_id for s in engine.submitted[3:]}  # never ran again


def test_a_request_the_engine_keeps_dying_under_ends_with_error() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    engine = RestartableFakeBackend(step_s=0.005)
    worker = WorkerThread(bus, engine, fast_restarts(max_engine_deaths=2)).start()
    client.send(make_request("poison", prompt=[3], max_tokens=10_000))
    for restarts in (1, 2):
        client.wait(lambda: len(engine._running) == 1, 5, "for it to run")
        engine.crash()
        if restarts == 1:
            client.wait(lambda: worker.worker.stats.engine_restarts == 1, 5, "restart")
    client.wait_finished(["poison"])
    assert client.view.streams["poison"].finish_reason == "error"
    assert worker.worker.stats.healthy
    worker.stop()


def test_a_worker_whose_engine_will_not_start_gives_up_unhealthy() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    engine = RestartableFakeBackend(failed_starts=3, step_s=0.005)
    config = fast_restarts(engine_max_failed_starts=3, engine_restart_max_s=0.1)
    worker = WorkerThread(bus, engine, config).start()
    client.send(make_request("r", max_tokens=10_000))
    client.wait(lambda: len(engine._running) == 1, 5, "for it to run")
    engine.crash()
    client.wait_finished(["r"])
    assert client.view.streams["r"].finish_reason == "error"
    # what it held is answered as unavailable (a 503), naming what took the engine down
    last = client.view.streams["r"].deltas[-1]
    assert last.error_code == ENGINE_UNAVAILABLE
    assert last.error == "no engine is up: the engine died"
    worker.thread.join(10.0)
    assert isinstance(worker.error, EngineDeadError)
    assert not worker.worker.stats.healthy and not worker.worker.health()


class _Stream:
    token_ids: list[int] = []


_NONE = _Stream()


def test_restart_backoff_doubles_to_its_cap_and_resets_after_a_long_run() -> None:
    backoff = RestartBackoff(initial_s=0.5, max_s=30.0, reset_after_s=60.0)
    delays = [backoff.delay(up_s=1.0) for _ in range(8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.delay(up_s=60.0) == 0.5  # it ran a minute: not a crash loop
    assert backoff.delay(up_s=0.0) == 1.0


@pytest.mark.slow  # the engine process imports torch, twice
def test_a_killed_engine_process_restarts_and_its_requests_resume(tmp_path: Path) -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    engine = ProcessEngineBackend(EngineSpec("tiny-llama", CONFIG, tmp_path))
    config = EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01, engine_restart_initial_s=0.2)
    worker = WorkerThread(bus, engine, config, MemoryProgressStore()).start(60.0)
    stats = worker.worker.stats

    client.send(*(request(f"ref{i}", p) for i, p in enumerate(PROMPTS)))
    client.wait_finished([f"ref{i}" for i in range(len(PROMPTS))], timeout_s=60)
    first_pid = engine.pid
    assert first_pid is not None

    ids = [f"r{i}" for i in range(len(PROMPTS))]
    client.send(*(request(rid, p) for rid, p in zip(ids, PROMPTS, strict=True)))

    def streaming() -> bool:
        streams = client.view.streams
        return all(len(streams[r].token_ids) >= 10 for r in ids if r in streams) and all(
            r in streams for r in ids
        )

    client.wait(streaming, 60, "for every request to stream")
    os.kill(first_pid, signal.SIGKILL)
    client.wait(lambda: not stats.ready, 10, "for the worker to say it is not ready")
    assert not stats.engine_up and stats.healthy
    client.wait_finished(ids, timeout_s=120)
    client.wait(lambda: stats.ready, 30, "for the worker to be ready again")
    assert stats.engine_restarts == 1 and engine.health() and engine.pid != first_pid
    worker.stop()
    client.pump()

    for i, rid in enumerate(ids):
        ref, got = client.view.streams[f"ref{i}"], client.view.streams[rid]
        assert len(ref.token_ids) == MAX_TOKENS and ref.finish_reason == "length"
        assert got.token_ids == ref.token_ids and got.text == ref.text, rid
        assert got.finish_reason == "length" and got.num_terminal == 1
        assert got.attempt >= 1  # the new engine ran it as a new attempt
        usage = sorted((u for u in client.usage if u.request_id == rid), key=lambda u: u.attempt)
        # the killed attempt's usage: what its progress says it published (estimated);
        # together the attempts bill exactly the tokens the client received
        assert sum(u.completion_tokens for u in usage) == MAX_TOKENS, usage
        assert [u.attempt for u in usage] == list(range(usage[0].attempt, got.attempt + 1))
        assert usage[-1].finish_reason == "length" and not usage[-1].estimated
        assert all(u.estimated and u.finish_reason == "error" for u in usage[:-1])
        assert_billed_as_shown(client, rid, len(PROMPTS[i]))
