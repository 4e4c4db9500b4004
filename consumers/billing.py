"""Billing consumer: usage records → the usage ledger, priced at write, exactly once.

Runs under the shared consume loop (group `billing`, topic `sluice.usage.v1`). `handle`
returns only after the ledger transaction has committed, and the loop commits offsets
only after `handle` returns (docs/architecture.md §5.2); a crash in between redelivers,
and the ledger's primary key (request_id, attempt) turns the redelivery into a no-op.

One transaction per record: the loop hands records over one at a time and has no
end-of-batch hook, so batching the inserts per poll would need one (measured need first).
A database outage raises `StoreUnavailable` (retryable): the loop backs off and retries
for as long as `billing_loop_config` allows, so usage is delayed, never dropped.
"""

from __future__ import annotations

import logging

from sluice.bus.base import EventBus, Record
from sluice.bus.codec import decode_as
from sluice.bus.messages import Message, UsageRecord
from sluice.bus.topics import USAGE_TOPIC
from sluice.consumers.loop import ConsumeLoop, LoopConfig
from sluice.storage.errors import InvalidInput
from sluice.storage.ledger import UsageLedger
from sluice.tracing.metrics import BillingLag

logger = logging.getLogger(__name__)


def decode_usage(record: Record) -> Message:
    """Whatever the topic is called (tests, replays from a copy): it carries usage."""
    return decode_as(UsageRecord, record.value)


BILLING_GROUP = "billing"


def billing_loop_config() -> LoopConfig:
    """Retry a failing write for about an hour (5 s apart) before dead-lettering it."""
    return LoopConfig(max_attempts=720, backoff_initial_s=0.1, backoff_max_s=5.0)


class BillingHandler:
    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        self.inserted = 0
        self.duplicates = 0
        self.lag = BillingLag()  # sluice_billing_lag_seconds, sluice_tokens_billed_total

    def handle(self, message: Message, record: Record) -> None:
        if not isinstance(message, UsageRecord):
            raise InvalidInput(f"billing expects UsageRecord, got {type(message).__name__}")
        new = self.ledger.record([message])  # committed when this returns
        self.inserted += new
        self.duplicates += 1 - new
        self.lag.billed(message, new=bool(new))
        if not new:
            logger.debug(
                "duplicate usage ignored request_id=%s attempt=%s tenant_id=%s",
                message.request_id,
                message.attempt,
                message.tenant_id,
            )


def billing_loop(
    bus: EventBus, ledger: UsageLedger, *, group_id: str = BILLING_GROUP, topic: str = USAGE_TOPIC
) -> ConsumeLoop:
    handler = BillingHandler(ledger)
    config = billing_loop_config()
    return ConsumeLoop(bus, group_id, [topic], handler, config=config, decoder=decode_usage)
