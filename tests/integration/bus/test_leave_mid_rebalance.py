"""A member that leaves while a rebalance it is part of runs does not wedge its group.

Tansu's coordinator (0.6) never finishes a rebalance whose member left mid-way: every
later join is answered "rebalance in progress" and the topic goes unread (a rolling
restart of engine workers hit it). The Kafka adapter's close waits for such a
rebalance to finish first (`KafkaConsumer._settle`); on Kafka the wait is just shorter.
"""

from __future__ import annotations

import time

import pytest

from sluice.bus.base import TopicSpec
from sluice.bus.kafka import KafkaConfig, KafkaConsumer, KafkaEventBus

pytestmark = pytest.mark.kafka


def _poll_until_assigned(consumer: KafkaConsumer, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        consumer.poll(0.1)
        if consumer.assignment():
            return True
    return False


def test_a_member_leaving_mid_rebalance_leaves_a_group_others_can_join(
    kafka_bootstrap: str, topic: str, group: str
) -> None:
    bus = KafkaEventBus(KafkaConfig(bootstrap=kafka_bootstrap, client_id="leave-mid-rebalance"))
    try:
        bus.create_topics([TopicSpec(topic, 6)])
        first, second = bus.consumer(group, [topic]), bus.consumer(group, [topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (first.assignment() and second.assignment()):
            first.poll(0.05)
            second.poll(0.05)
        assert first.assignment() and second.assignment()
        first.close()  # the group rebalances: `second` gives its share back and rejoins
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and second.assignment():
            second.poll(0.05)
        assert not second.assignment(), "no rebalance after a member left"
        second.close()  # mid-rebalance
        third = bus.consumer(group, [topic])
        try:
            assert _poll_until_assigned(third, 30), "the group assigns nobody any more"
        finally:
            third.close()
    finally:
        bus.close()
