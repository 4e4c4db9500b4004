"""The tracing consumer's handler: telemetry records → spans, run by the shared loop.

Group `tracing` on `sluice.telemetry.v1` (`sluice worker tracing`, or a thread of
`sluice serve` when an exporter is configured). Spans go to the process's global
TracerProvider (`tracing.setup.configure_tracing`), whose batch processor exports them
on its own thread, so handling a record only builds spans. Delivery is at least once: a
record redelivered to this member is skipped (the recent (request_id, attempt) pairs are
remembered); one redelivered after a rebalance to another member gives duplicate spans.
A record that fails to become spans is logged and dropped, never retried: a trace is
worth less than the loop's progress.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from opentelemetry import trace

from sluice.bus.base import EventBus, Record
from sluice.bus.codec import decode_as
from sluice.bus.messages import Message, TelemetryRecord
from sluice.bus.topics import TELEMETRY_TOPIC
from sluice.consumers.loop import ConsumeLoop
from sluice.consumers.tracing.spans import emit_attempt_spans

logger = logging.getLogger(__name__)

TRACING_GROUP = "tracing"
_REMEMBERED = 10_000


class NotTelemetry(Exception):
    """The tracing consumer was handed something other than a TelemetryRecord."""

    retryable = False


def decode_telemetry(record: Record) -> Message:
    return decode_as(TelemetryRecord, record.value)


class TracingHandler:
    """Turns each attempt's telemetry record into its spans (`emit_attempt_spans`)."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self.tracer = tracer
        self.emitted = 0
        self.failed = 0
        self._seen: OrderedDict[tuple[str, int, bool], None] = OrderedDict()

    def handle(self, message: Message, record: Record) -> None:
        if not isinstance(message, TelemetryRecord):
            raise NotTelemetry(f"tracing expects TelemetryRecord, got {type(message).__name__}")
        key = (message.request_id, message.attempt, message.estimated)
        if key in self._seen:
            return
        try:
            emit_attempt_spans(message, record.headers, self.tracer)
        except Exception:  # telemetry never stops the loop
            self.failed += 1
            logger.exception(
                "spans not built request_id=%s attempt=%s", message.request_id, message.attempt
            )
            return
        self.emitted += 1
        self._seen[key] = None
        if len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)


def tracing_loop(
    bus: EventBus,
    *,
    tracer: trace.Tracer | None = None,
    group_id: str = TRACING_GROUP,
    topic: str = TELEMETRY_TOPIC,
) -> ConsumeLoop:
    """The tracing consumer: `TracingHandler` under the shared consume loop."""
    handler = TracingHandler(tracer)
    return ConsumeLoop(bus, group_id, [topic], handler, decoder=decode_telemetry)
