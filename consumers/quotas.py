"""Quotas consumer: usage records → quota settlement (tokens, concurrency, spend).

Runs under the shared consume loop (group `quotas`, topic `sluice.usage.v1`). Each
record settles its (request_id, attempt) once: the unused token reservation goes back,
the concurrency lease ends, the estimate held against the budget is replaced by the
actual cost. Settlement is deduplicated inside the quota store, so redelivery, replays
and the gateway's own early settlement on the terminal delta all count once.
A Redis outage raises `StoreUnavailable` (retryable): the loop keeps retrying.
"""

from __future__ import annotations

import logging

from sluice.billing.admission import UsageSettler
from sluice.bus.base import EventBus, Record
from sluice.bus.codec import decode_as
from sluice.bus.messages import Message, UsageRecord
from sluice.bus.topics import USAGE_TOPIC
from sluice.consumers.loop import ConsumeLoop, LoopConfig
from sluice.storage.errors import InvalidInput

logger = logging.getLogger(__name__)


def decode_usage(record: Record) -> Message:
    """Whatever the topic is called (tests, replays from a copy): it carries usage."""
    return decode_as(UsageRecord, record.value)


QUOTAS_GROUP = "quotas"


class QuotaHandler:
    def __init__(self, settler: UsageSettler) -> None:
        self.settler = settler
        self.settled = 0
        self.duplicates = 0

    def handle(self, message: Message, record: Record) -> None:
        if not isinstance(message, UsageRecord):
            raise InvalidInput(f"quotas expects UsageRecord, got {type(message).__name__}")
        if self.settler.settle_usage(message):
            self.settled += 1
        else:
            self.duplicates += 1


def quotas_loop(
    bus: EventBus,
    settler: UsageSettler,
    *,
    group_id: str = QUOTAS_GROUP,
    topic: str = USAGE_TOPIC,
) -> ConsumeLoop:
    config = LoopConfig(max_attempts=720, backoff_initial_s=0.1, backoff_max_s=5.0)
    handler = QuotaHandler(settler)
    return ConsumeLoop(bus, group_id, [topic], handler, config=config, decoder=decode_usage)
