"""`Consumer.lag()` on both transports: what a group has not yet consumed, per partition,
also while a partition is paused (the engine worker pauses exactly as its backlog grows)."""

from __future__ import annotations

from sluice.bus.base import EventBus, Record, TopicPartition, TopicSpec
from tests.waiting import wait_until


def test_lag_is_what_the_member_has_not_consumed_paused_or_not(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 1)])
    tp = TopicPartition(topic, 0)
    for n in range(10):
        bus.publish(topic, f"{n}".encode(), partition=0)
    bus.flush()
    consumer = bus.consumer(group, [topic])
    got: list[Record] = []
    try:
        wait_until(lambda: bool(got.extend(consumer.poll(0.2, 4))) or len(got) > 0, 30, "records")
        wait_until(lambda: consumer.lag().get(tp) == 10 - len(got), 30, f"lag {10 - len(got)}")
        consumer.pause([tp])
        for n in range(5):  # one batch each: Tansu answers a batch's base offset as the end
            bus.publish(topic, f"more {n}".encode(), partition=0).result(10)
        wait_until(lambda: consumer.lag().get(tp) == 15 - len(got), 30, f"lag {15 - len(got)}")
        consumer.resume([tp])
        wait_until(lambda: bool(got.extend(consumer.poll(0.2))) or len(got) >= 15, 30, "all 15")
        wait_until(lambda: consumer.lag().get(tp) == 0, 30, "lag 0")
    finally:
        consumer.close()
