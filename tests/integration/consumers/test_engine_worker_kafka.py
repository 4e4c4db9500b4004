"""The engine worker on a real Kafka broker (Tansu): lanes in, coalesced deltas and usage
out, low-watermark commits that a later member of the group honours."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.topics import Lane, request_topics
from sluice.consumers.engine_worker import EngineWorkerConfig
from tests.unit.consumers.engine_harness import (
    POOL,
    Client,
    WorkerThread,
    create_topics,
    make_request,
)
from tests.unit.consumers.sim_engine import RecordingSimBackend, sim_reply
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def kafka_bus(dedicated_kafka: str) -> Iterator[KafkaEventBus]:
    bus = KafkaEventBus(KafkaConfig(bootstrap=dedicated_kafka, client_id="sluice-engine-test"))
    create_topics(bus, request_partitions=2)
    yield bus
    bus.close()


def test_worker_on_kafka_streams_every_lane_and_commits(kafka_bus: KafkaEventBus) -> None:
    group = f"engine-{uuid.uuid4().hex[:8]}"
    config = EngineWorkerConfig(group_id=group, poll_timeout_s=0.05, tick_s=0.01)
    worker = WorkerThread(kafka_bus, RecordingSimBackend(step_s=0.005), config).start(30.0)
    client = Client(kafka_bus)
    run = uuid.uuid4().hex[:6]
    requests = [
        make_request(f"{run}-{lane.value}-{i}", lane=lane, prompt=[i, 3], tenant=f"t{i}")
        for lane in Lane
        for i in range(3)
    ]
    client.send(*requests)
    ids = [r.request_id for r in requests]
    client.wait_finished(ids, timeout_s=45)
    worker.stop(timeout_s=10)
    for r in requests:
        stream = client.view.streams[r.request_id]
        assert stream.token_ids == sim_reply(r.prompt_token_ids, 8)[0]
        assert stream.num_terminal == 1
    mine = [u for u in client.usage if u.request_id in set(ids)]
    assert sorted(u.request_id for u in mine) == sorted(ids)

    # a later member of the same group starts after the committed offsets: nothing of ours
    assert worker.worker.group_id == f"{group}.{POOL}"  # each pool reads in its own group
    successor = kafka_bus.consumer(worker.worker.group_id, list(request_topics(POOL)))
    seen: list[str] = []
    fence = f"fence-{run}"

    def read() -> None:
        seen.extend(r.value.decode() for r in successor.poll(0.2, 500))

    wait_until(lambda: read() or successor.assignment(), 20, "the successor's assignment")
    # a fence in every partition: whatever the group had left would come before it
    fences = [(t, p) for t in request_topics(POOL) for p in range(kafka_bus.num_partitions(t))]
    for topic, partition in fences:
        kafka_bus.publish(topic, fence.encode(), partition=partition).result(30)
    wait_until(lambda: read() or seen.count(fence) >= len(fences), 30, "every fence")
    successor.close()
    client.close()
    assert not [v for v in seen if run in v and v != fence], worker.worker.stats
