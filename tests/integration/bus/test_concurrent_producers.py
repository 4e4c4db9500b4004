"""A live reader of one partition written by several producers at once reads every record.

Tansu's memory storage answers such a fetch without a record it stored (the reader skips
it; a later read from before it finds it); the Kafka adapter fetches a hole in the offsets
again (`bus.kafka._OffsetGaps`). The reply topic of a gateway is such a partition: every
engine worker writes it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from sluice.bus.base import Record, TopicSpec
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from tests.waiting import wait_until

pytestmark = pytest.mark.kafka

PRODUCERS = 4
PER_PRODUCER = 3000


def test_a_live_reader_gets_every_record_of_concurrent_producers(
    kafka_bootstrap: str, topic: str, group: str
) -> None:
    buses = [
        KafkaEventBus(KafkaConfig(bootstrap=kafka_bootstrap, client_id=f"producer-{n}"))
        for n in range(PRODUCERS + 1)
    ]
    reader_bus, producers = buses[0], buses[1:]
    reader_bus.create_topics([TopicSpec(topic, 1)])
    consumer = reader_bus.consumer(group, [topic], offset_reset="earliest")
    got: list[Record] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            got.extend(consumer.poll(0.1))

    def write(n: int, bus: KafkaEventBus) -> None:
        for i in range(PER_PRODUCER):
            bus.publish(topic, f"{n}:{i}".encode(), key=b"one-key")
            if i % 20 == 0:  # bursts, as engine steps publish
                time.sleep(0.002)  # a pause between bursts: the load's shape
        bus.flush()

    deadline = time.monotonic() + 30
    while not consumer.assignment() and time.monotonic() < deadline:
        got.extend(consumer.poll(0.1))  # reading while they write is the point
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    writers = [threading.Thread(target=write, args=(n, b)) for n, b in enumerate(producers)]
    try:
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        with contextlib.suppress(AssertionError):  # the asserts below name what is missing
            wait_until(lambda: len(got) >= PRODUCERS * PER_PRODUCER, 30, "every record")
    finally:
        done.set()
        reader.join(5)
        consumer.close()
        for bus in buses:
            bus.close()
    values = {r.value for r in got}
    missing = [f"{n}:{i}" for n in range(PRODUCERS) for i in range(PER_PRODUCER)]
    missing = [v for v in missing if v.encode() not in values]
    assert not missing, f"{len(missing)} records never read, e.g. {missing[:5]}"
    assert len(got) == len(values), "a record read twice"
