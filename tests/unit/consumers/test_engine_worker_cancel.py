"""Cancels (on Kafka, buffered, running, by batch), deadlines and the SIGTERM drain."""

from __future__ import annotations

import time

from sluice.bus.base import TopicPartition
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import Lane, request_topic
from sluice.consumers.engine_worker import EngineWorkerConfig
from tests.unit.consumers.engine_harness import (
    POOL,
    Client,
    WorkerThread,
    committed,
    create_topics,
    make_request,
    wait_controls_read,
)
from tests.unit.consumers.sim_engine import RecordingSimBackend

FAST = EngineWorkerConfig(poll_timeout_s=0.01, tick_s=0.005, max_engine_waiting=1)


def start(
    max_running: int = 1, step_s: float = 0.005
) -> tuple[MemoryEventBus, Client, WorkerThread]:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    worker = WorkerThread(bus, RecordingSimBackend(step_s=step_s, max_running=max_running), FAST)
    return bus, client, worker.start()


def submitted_ids(worker: WorkerThread) -> set[str]:
    backend = worker.backend
    assert isinstance(backend, RecordingSimBackend)
    return {r.request_id for r in backend.submitted}


def test_cancel_before_the_request_arrives_answers_abort_without_running() -> None:
    bus, client, worker = start()
    client.cancel("late")
    wait_controls_read(bus)  # the broadcast cancel is consumed before the request
    client.send(make_request("late"), make_request("other", tenant="t2"))
    client.cancel("other")  # another tenant's cancel (tenant t1) must not touch it
    client.wait_finished(["late", "other"])
    worker.stop()
    stream = client.view.streams["late"]
    assert stream.finish_reason == "abort" and stream.token_ids == []
    assert client.view.streams["other"].finish_reason == "length"
    usage = {u.request_id: u for u in client.usage}
    assert usage["late"].completion_tokens == 0 and usage["late"].finish_reason == "abort"
    assert "late" not in submitted_ids(worker)


def test_cancel_buffered_running_and_by_batch() -> None:
    bus, client, worker = start()
    client.send(make_request("long", max_tokens=400))
    client.send(make_request("queued"))
    client.send(*[make_request(f"b{i}", batch_id="batch1", lane=Lane.BATCH) for i in range(3)])
    client.wait(lambda: len(client.view.streams.get("long", _Empty).token_ids) >= 3)
    client.cancel("queued")
    client.cancel(batch_id="batch1")
    client.wait_finished(["queued", "b0", "b1", "b2"])
    # beside the running one the engine holds one waiting request, plus one interactive
    # request passing a full engine (`_admit_urgent`); the rest never ran
    backend = worker.backend
    assert isinstance(backend, RecordingSimBackend)
    assert len(submitted_ids(worker) - {"long"}) <= 2
    assert submitted_ids(worker) - {"long"} <= set(backend.aborts)
    client.cancel("long")
    client.wait_finished(["long"])
    worker.stop()
    client.pump()
    for rid in ["queued", "b0", "b1", "b2", "long"]:
        assert client.view.streams[rid].finish_reason == "abort"
        assert client.view.streams[rid].num_terminal == 1
    usage = {u.request_id: u for u in client.usage}
    assert len(client.usage) == len(usage) == 5
    long = client.view.streams["long"]
    assert usage["long"].completion_tokens == len(long.token_ids) < 400
    assert committed(bus)[TopicPartition(request_topic(Lane.INTERACTIVE, POOL), 0)] == 2


def test_deadlines_expire_waiting_requests_unrun_and_running_ones_with_their_tokens() -> None:
    _, client, worker = start(max_running=1, step_s=0.01)
    now_ms = int(time.time() * 1000)
    client.send(make_request("running", max_tokens=1000, deadline_ms=now_ms + 300))
    client.send(make_request("filler"))  # holds the engine's one waiting slot
    client.send(make_request("buffered", deadline_ms=now_ms + 100))
    client.send(make_request("expired", deadline_ms=now_ms - 1))
    client.wait_finished(["running", "buffered", "expired", "filler"])
    worker.stop()
    usage = {u.request_id: u for u in client.usage}
    for rid in ["running", "buffered", "expired"]:
        assert client.view.streams[rid].finish_reason == "deadline"
    assert usage["buffered"].completion_tokens == usage["expired"].completion_tokens == 0
    assert submitted_ids(worker) == {"running", "filler"}
    generated = len(client.view.streams["running"].token_ids)
    assert 0 < generated < 1000 and usage["running"].completion_tokens == generated


def test_drain_finishes_or_aborts_in_flight_work_and_leaves_the_buffer_to_the_group() -> None:
    bus, client, worker = start(max_running=1, step_s=0.01)
    client.send(make_request("inflight", max_tokens=1000), make_request("filler"))
    client.send(make_request("buffered"))  # the engine holds two: this one stays local
    client.wait(lambda: len(client.view.streams.get("inflight", _Empty).token_ids) >= 2)
    worker.worker.stop(drain_timeout_s=0.1)
    worker.thread.join(5)
    assert not worker.thread.is_alive() and worker.error is None
    client.wait_finished(["inflight", "filler"])
    assert client.view.streams["inflight"].finish_reason == "abort"
    assert "buffered" not in client.view.streams
    assert committed(bus)[TopicPartition(request_topic(Lane.INTERACTIVE, POOL), 0)] == 2
    successor = WorkerThread(bus, RecordingSimBackend(), FAST).start()
    client.wait_finished(["buffered"])
    successor.stop()
    assert client.view.streams["buffered"].finish_reason == "length"


class _Stream:
    token_ids: list[int] = []


_Empty = _Stream()
