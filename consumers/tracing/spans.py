"""One attempt's engine-side spans, built from its `TelemetryRecord` after the fact.

The engine worker's hot path creates no spans: it publishes one `TelemetryRecord` per
attempt, with the request record's trace context in its headers, and this module turns
it into two spans with explicit start and end times (unix ms → ns):

    process sluice.requests.<lane>.v1   CONSUMER  queued → finished
      events: received (a worker polled it: the bus queue ends), admitted (the worker's
      fair queue let it in), scheduled (submitted to the engine)
      chat <model>                      INTERNAL  submitted → finished (GenAI attributes)
        events: first_token (prefill ends)

Where the time went is in events and in seconds-valued attributes (`sluice.latency.*` on
`process`; vLLM's `gen_ai.latency.*` on the inference span) rather than in a child span
per phase: phase spans would double the spans a request costs, and every span is
built, encoded and exported in the serving process.

`process` is parented to the gateway's `send` span (the context in the headers) rather
than linked to it, as the messaging conventions allow: a request/response pipeline reads
best as one trace per request, and a failover's second attempt is a second `process`
subtree in that trace (`sluice.attempt`). An attempt whose worker died is known only
from its estimate (`TelemetryRecord.estimated`): its `process` and inference spans run
from the request's creation to its resumption, without events.
"""

from __future__ import annotations

from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from sluice.bus.messages import TelemetryRecord
from sluice.bus.topics import pool_id, request_topic
from sluice.tracing import spans as names
from sluice.tracing.propagation import Headers, extract_context

# the baggage entry the gateway sets per route (chat or text_completion); a request
# without it (a batch line, an older gateway) is a completion over token ids
OPERATION_BAGGAGE = names.GEN_AI_OPERATION
DEFAULT_OPERATION = "text_completion"


def _ns(ms: int) -> int:
    return ms * 1_000_000


def emit_attempt_spans(
    record: TelemetryRecord, headers: Headers, tracer: trace.Tracer | None = None
) -> None:
    """Build and end the spans of one attempt, parented to the context in `headers`."""
    tracer = tracer or names.tracer()
    parent = extract_context(headers)
    t = record.timings
    topic = request_topic(record.lane, pool_id(record.model))
    # no consumer group attribute: the record does not say which group (it is configurable)
    attrs = names.kafka_attributes("process", topic, key=record.tenant_id)
    attrs.update(_sluice_attributes(record))
    if not record.estimated:
        attrs.update(
            names.without_none(
                {
                    names.QUEUE_SECONDS: _seconds(t.queued_ms, t.received_ms),
                    names.ADMISSION_SECONDS: _seconds(t.received_ms, t.scheduled_ms),
                }
            )
        )
    process = tracer.start_span(
        names.process_span_name(topic),
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=attrs,
        start_time=_ns(t.queued_ms),
    )
    if not record.estimated:
        _events(
            process,
            (names.RECEIVED_EVENT, t.received_ms),
            (names.ADMITTED_EVENT, t.admitted_ms),
            (names.SCHEDULED_EVENT, t.scheduled_ms),
        )
    if t.scheduled_ms is not None or record.estimated:
        _inference(tracer, trace.set_span_in_context(process, parent), parent, record)
    process.end(end_time=_ns(t.finished_ms))


def _sluice_attributes(record: TelemetryRecord, *, ids: bool = True) -> dict[str, AttributeValue]:
    """Sluice's attributes of an attempt; the inference span leaves out the request id
    (its `gen_ai.response.id`) and the worker's (on its parent): every attribute is
    encoded and exported once per span."""
    return names.without_none(
        {
            names.REQUEST_ID: record.request_id if ids else None,
            names.TENANT_ID: record.tenant_id,
            names.LANE: record.lane.value,
            names.ATTEMPT: record.attempt,
            names.BATCH_ID: record.batch_id,
            names.WORKER_ID: record.worker_id if ids else None,
            names.ESTIMATED: record.estimated or None,
        }
    )


def _seconds(start_ms: int | None, end_ms: int | None) -> float | None:
    """The time between two points, when both are known."""
    if start_ms is None or end_ms is None:
        return None
    return max(0, end_ms - start_ms) / 1000


def _events(span: trace.Span, *events: tuple[str, int | None]) -> None:
    """Events at the known points of an attempt (a request answered before it ran has
    no `scheduled`, one that failed before its first token no `first_token`)."""
    for name, at_ms in events:
        if at_ms is not None:
            span.add_event(name, timestamp=_ns(at_ms))


def _inference(
    tracer: trace.Tracer, inside: Context, parent: Context, record: TelemetryRecord
) -> None:
    t = record.timings
    operation = baggage.get_baggage(OPERATION_BAGGAGE, parent) or DEFAULT_OPERATION
    attrs = names.without_none(
        {
            names.GEN_AI_OPERATION: str(operation),
            names.GEN_AI_PROVIDER: names.PROVIDER,
            names.GEN_AI_REQUEST_MODEL: record.model,
            names.GEN_AI_REQUEST_MAX_TOKENS: record.max_tokens,
            names.GEN_AI_RESPONSE_ID: record.request_id,
            names.GEN_AI_FINISH_REASONS: [record.finish_reason] if record.finish_reason else None,
        }
    )
    attrs.update(
        names.usage_attributes(
            record.num_prompt_tokens, record.num_output_tokens, record.num_cached_tokens
        )
    )
    attrs.update(_sluice_attributes(record, ids=False))
    if not record.estimated:
        attrs.update(
            names.without_none(
                {
                    names.LATENCY_TIME_IN_QUEUE: _seconds(t.queued_ms, t.scheduled_ms),
                    names.LATENCY_TTFT: _seconds(t.queued_ms, t.first_token_ms),
                    names.LATENCY_PREFILL: _seconds(t.scheduled_ms, t.first_token_ms),
                    names.LATENCY_DECODE: _seconds(t.first_token_ms, t.finished_ms),
                    names.LATENCY_E2E: _seconds(t.queued_ms, t.finished_ms),
                }
            )
        )
    start_ms = t.queued_ms if t.scheduled_ms is None else t.scheduled_ms
    span = tracer.start_span(
        names.inference_span_name(str(operation), record.model),
        context=inside,
        kind=SpanKind.INTERNAL,
        attributes=attrs,
        start_time=_ns(start_ms),
    )
    if record.finish_reason == "error":
        span.set_status(Status(StatusCode.ERROR, "the engine failed the request"))
        span.set_attribute("error.type", "engine_error")
    if not record.estimated:
        _events(span, (names.FIRST_TOKEN_EVENT, t.first_token_ms))
    span.end(end_time=_ns(max(start_ms, t.finished_ms)))
