"""Embedded mode over many streams: the memory bus gives back what every group has read.

`sluice serve` runs the gateway, the engine worker and the side consumers on one
MemoryEventBus; its topic logs used to keep every request and every token batch for the
life of the process. Counted in retained records and in bytes the bus allocated
(tracemalloc), never in wall-clock time or RSS.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sluice.api import service
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from tests.unit.api.conftest import API_KEY
from tests.unit.api.fakes import FakeEngineWorker

WINDOW = 16
EMPTY_GROUP_RETENTION_S = 300.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def memory_bus(clock: FakeClock) -> Iterator[MemoryEventBus]:
    bus = MemoryEventBus(
        retention_records=WINDOW, empty_group_retention_s=EMPTY_GROUP_RETENTION_S, clock=clock
    )
    bus.create_topics(
        TopicLayout(request_partitions=2, tokens_partitions=1, pools=("tiny",)).specs()
    )
    yield bus
    bus.close()


@pytest.fixture
def engine(memory_bus: MemoryEventBus) -> Iterator[FakeEngineWorker]:
    worker = FakeEngineWorker(memory_bus, reply="Hey").start()  # short: many streams
    yield worker
    worker.stop()


def _run_streams(client: TestClient, n: int) -> None:
    for i in range(n):
        if i % 2:
            r = client.post("/v1/chat/completions", json=CHAT)
            assert r.json()["choices"][0]["message"]["content"] == "Hey"
        else:
            with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
                body = "".join(s.iter_text())
            assert "[DONE]" in body


def _bus_bytes(snapshot: tracemalloc.Snapshot) -> int:
    only_bus = snapshot.filter_traces([tracemalloc.Filter(True, "*bus/memory.py")])
    return sum(stat.size for stat in only_bus.statistics("filename"))


def test_many_streams_leave_a_bounded_bus(
    app: FastAPI, memory_bus: MemoryEventBus, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gateway commits where it read at most every 0.5 s, and the bus keeps what it read
    # since (a rebalance resumes there): commit at every poll, so that what stays depends
    # on the streams run, not on how fast this machine ran them.
    monkeypatch.setattr(service, "REPLY_COMMIT_INTERVAL_S", 0.0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tracemalloc.start()
    try:
        # two gateway lifetimes: the first one's reply group (each start joins a new one)
        # must not pin the reply topic once its commits expired
        for _ in range(2):
            clock.now += EMPTY_GROUP_RETENTION_S + 1
            with TestClient(app, headers=headers) as client:
                _run_streams(client, 20)
                warm = _bus_bytes(tracemalloc.take_snapshot())
                _run_streams(client, 60)
                grown = _bus_bytes(tracemalloc.take_snapshot()) - warm
                # each stream adds a request and ~4 token batches; a window per partition
                # written (a lane's 2 partitions and the reply topic) is all that stays
                assert memory_bus.num_retained() <= 3 * WINDOW
                assert grown < 16 * 1024, f"the bus grew by {grown} bytes over 60 streams"
    finally:
        tracemalloc.stop()
