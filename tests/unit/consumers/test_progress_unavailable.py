"""A progress store that cannot be reached: `ProgressUnavailable`, and the worker retries."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from sluice.bus.memory import MemoryEventBus
from sluice.consumers.progress import (
    AttemptStart,
    MemoryProgressStore,
    ProgressUnavailable,
    RedisProgressStore,
    StepProgress,
)
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request
from tests.unit.consumers.sim_engine import sim_reply


class FlakyProgressStore(MemoryProgressStore):
    """The memory store, unreachable for its first `num_failures` begins and records."""

    def __init__(self, num_failures: int) -> None:
        super().__init__()
        self.begin_failures = self.record_failures = num_failures
        self._flaky_lock = threading.Lock()

    def begin_attempts(self, requests: Sequence[tuple[str, int]]) -> list[AttemptStart]:
        with self._flaky_lock:
            if self.begin_failures > 0:
                self.begin_failures -= 1
                raise ProgressUnavailable("injected")
        return super().begin_attempts(requests)

    def record(self, steps: Sequence[StepProgress]) -> set[str]:
        with self._flaky_lock:
            if self.record_failures > 0:
                self.record_failures -= 1
                raise ProgressUnavailable("injected")
        return super().record(steps)


def test_redis_store_that_cannot_connect_raises_progress_unavailable() -> None:
    store = RedisProgressStore("redis://127.0.0.1:1/0")  # nothing listens on port 1
    with pytest.raises(ProgressUnavailable):
        store.begin_attempts([("r", 0)])
    with pytest.raises(ProgressUnavailable):
        store.record([StepProgress("r", 0, 0, [1], 1)])
    store.close()


def test_requests_run_once_the_progress_store_answers_again() -> None:
    bus = MemoryEventBus()
    create_topics(bus)
    store = FlakyProgressStore(num_failures=2)
    worker = WorkerThread(bus, progress=store).start()
    client = Client(bus)
    request = make_request("r1", max_tokens=5)
    client.send(request)
    client.wait_finished(["r1"])
    worker.stop()
    stream = client.view.streams["r1"]
    assert stream.token_ids == sim_reply(request.prompt_token_ids, 5)[0]
    assert stream.finish_reason == "length" and stream.num_terminal == 1
    assert store.begin_failures == 0
