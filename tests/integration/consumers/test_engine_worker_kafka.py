"""The engine worker on a real Kafka broker (Tansu): lanes in, coalesced deltas and usage
out, low-watermark commits that a later member of the group honours."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.topics import REQUEST_TOPICS, Lane
from sluice.consumers.engine_worker import EngineWorkerConfig
from tests.unit.consumers.engine_fakes import FakeEngineBackend, greedy_tokens
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request

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
    worker = WorkerThread(kafka_bus, FakeEngineBackend(step_s=0.005), config).start(30.0)
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
        assert stream.token_ids == greedy_tokens(r.prompt_token_ids, 8)
        assert stream.num_terminal == 1
    mine = [u for u in client.usage if u.request_id in set(ids)]
    assert sorted(u.request_id for u in mine) == sorted(ids)

    # a later member of the same group starts after the committed offsets: nothing of ours
    successor = kafka_bus.consumer(group, list(REQUEST_TOPICS))
    seen: list[str] = []
    deadline, settled = time.monotonic() + 20, None
    while time.monotonic() < deadline and (settled is None or time.monotonic() < settled):
        seen += [rec.value.decode() for rec in successor.poll(0.2, 500)]
        if settled is None and successor.assignment():
            settled = time.monotonic() + 1.5  # fetched from the committed offsets by then
    successor.close()
    client.close()
    assert not [v for v in seen if run in v], worker.worker.stats
