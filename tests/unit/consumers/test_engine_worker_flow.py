"""Coalescing, low-watermark commits, backpressure, priority and fairness, end to end."""

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
    partition_tenants,
)
from tests.unit.consumers.sim_engine import RecordingSimBackend, sim_reply


def config(**overrides: object) -> EngineWorkerConfig:
    base: dict[str, object] = {"poll_timeout_s": 0.01, "tick_s": 0.005}
    base.update(overrides)
    return EngineWorkerConfig(**base)  # type: ignore[arg-type]


def test_one_message_per_step_per_reply_target_and_commits_reach_the_end() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    requests = [make_request(f"r{i}", prompt=[i], max_tokens=10) for i in range(8)]
    client.send(*requests)  # all waiting on the topic: one poll, one engine step each
    worker = WorkerThread(bus, RecordingSimBackend(step_s=0.01, max_running=8), config()).start()
    client.wait_finished([r.request_id for r in requests])
    worker.stop()
    deltas = sum(len(s.deltas) for s in client.view.streams.values())
    # at most one delta per token (the terminal delta rides with the last token); fewer
    # where a request's deltas of several steps were held for one message and merged
    assert 8 <= deltas <= 8 * 10
    assert client.view.num_batches <= 12  # ~one per step (10 steps), not one per token
    for r in requests:
        assert client.view.streams[r.request_id].token_ids == sim_reply(r.prompt_token_ids, 10)[0]
    assert committed(bus)[TopicPartition(request_topic(Lane.INTERACTIVE, POOL), 0)] == 8


def test_full_engine_pauses_partitions_and_commits_stay_below_unfinished_work() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    requests = [make_request(f"r{i:02}", prompt=[i], max_tokens=3 + i % 5) for i in range(40)]
    client.send(*requests)
    backend = RecordingSimBackend(step_s=0.002, max_running=2)
    cfg = config(max_engine_waiting=2, max_buffered_per_partition=4, max_records=4)
    worker = WorkerThread(bus, backend, cfg).start()
    tp = TopicPartition(request_topic(Lane.INTERACTIVE, POOL), 0)
    max_held, paused_seen = 0, False
    deadline = time.monotonic() + 20
    while len(client.usage) < 40:
        assert time.monotonic() < deadline
        stats = worker.worker.stats
        max_held = max(max_held, stats.held)
        paused_seen = paused_seen or stats.paused > 0
        mark = committed(bus).get(tp, 0)
        client.pump(0.005)
        finished = {u.request_id for u in client.usage}
        # every offset below the committed one is a finished request (usage confirmed)
        assert {r.request_id for r in requests[:mark]} <= finished
    worker.stop()
    assert paused_seen
    assert max_held <= 2 + 2 + 4 + 4  # running + waiting + buffered + one poll
    assert committed(bus)[tp] == 40


def test_a_full_engine_keeps_a_lookahead_of_each_partition_buffered() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    requests = [make_request(f"r{i:02}", prompt=[i], max_tokens=20) for i in range(30)]
    client.send(*requests)
    backend = RecordingSimBackend(step_s=0.002, max_running=1)
    cfg = config(max_engine_waiting=1, full_engine_lookahead=3, max_records=1)
    worker = WorkerThread(bus, backend, cfg).start()
    max_buffered = 0
    deadline = time.monotonic() + 20
    while len(client.usage) < 30:
        assert time.monotonic() < deadline
        max_buffered = max(max_buffered, worker.worker.stats.buffered)
        client.pump(0.002)
    worker.stop()
    # the admission buffer sees the partition's next requests, not just one, and no
    # more than the lookahead and one poll while the engine is full
    assert 3 <= max_buffered <= 3 + 1


def test_the_engine_holds_prompt_tokens_up_to_the_limit_and_the_rest_waits_in_the_worker() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    requests = [make_request(f"r{i:02}", prompt=[1, 2, 3, i], max_tokens=5) for i in range(20)]
    client.send(*requests)
    backend = RecordingSimBackend(step_s=0.002, max_running=1)
    cfg = config(max_engine_waiting=100, max_engine_waiting_tokens=10)
    worker = WorkerThread(bus, backend, cfg).start()
    max_waiting = 0
    deadline = time.monotonic() + 20
    while len(client.usage) < 20:
        assert time.monotonic() < deadline
        stats = backend.stats()
        max_waiting = max(max_waiting, stats.num_waiting + stats.num_pending)
        client.pump(0.002)
    worker.stop()
    # 4 tokens a prompt: a third request enters at 8 waiting tokens, a fourth never
    assert 2 <= max_waiting <= 3


def test_interactive_overtakes_a_batch_backlog_which_still_finishes() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    batch = [make_request(f"b{i:02}", lane=Lane.BATCH, prompt=[i], max_tokens=4) for i in range(30)]
    client.send(*batch)
    backend = RecordingSimBackend(step_s=0.002, max_running=1)
    worker = WorkerThread(bus, backend, config(max_engine_waiting=1)).start()
    client.wait(lambda: len(client.usage) >= 3)
    interactive = [make_request(f"i{i}", prompt=[100 + i], max_tokens=4) for i in range(3)]
    client.send(*interactive)
    client.wait_finished([r.request_id for r in batch + interactive], timeout_s=20)
    worker.stop()
    order = [u.request_id for u in client.usage]
    last_interactive = max(order.index(r.request_id) for r in interactive)
    assert last_interactive <= order.index("b02") + 3 + 3  # behind at most what the engine held


def test_interactive_requests_already_decoding_do_not_hold_back_a_new_one() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    backend = RecordingSimBackend(step_s=0.002, max_running=4)
    worker = WorkerThread(bus, backend, config(max_engine_waiting=2)).start()
    long = [make_request(f"i{i}", prompt=[100 + i], max_tokens=2000) for i in range(2)]
    client.send(*long)
    client.wait(lambda: all(client.view.streams.get(r.request_id) for r in long), what="decode")
    batch = [make_request(f"b{i}", lane=Lane.BATCH, prompt=[i], max_tokens=2000) for i in range(8)]
    client.send(*batch)
    client.wait(lambda: backend.stats().num_waiting >= 2, what="a full engine")
    client.send(make_request("i2", prompt=[7], max_tokens=4))
    # two interactive requests are in the engine, decoding: the new one still enters
    client.wait(lambda: any(r.request_id == "i2" for r in backend.submitted), timeout_s=2.0)
    assert not any(client.view.streams[r.request_id].finish_reason for r in long)
    worker.stop()


def test_a_tenant_with_ten_times_the_load_does_not_crowd_out_a_light_one() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=2)
    heavy, light = partition_tenants(2)
    client = Client(bus)
    reqs = [make_request(f"h{i:02}", tenant=heavy, lane=Lane.STANDARD) for i in range(60)]
    reqs += [make_request(f"l{i}", tenant=light, lane=Lane.STANDARD) for i in range(6)]
    client.send(*reqs)
    backend = RecordingSimBackend(step_s=0.001, max_running=1)
    # requests cost 4 + 8 tokens: a quantum of about one request alternates tenants
    cfg = config(max_engine_waiting=1, tenant_quantum_tokens=12)
    worker = WorkerThread(bus, backend, cfg).start()
    client.wait_finished([r.request_id for r in reqs], timeout_s=20)
    worker.stop()
    first = [u.tenant_id for u in client.usage[:14]]
    assert first.count(light) >= 5  # its half while both are backlogged (6 in all)
