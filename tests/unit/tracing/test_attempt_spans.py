"""The tracing consumer's spans of one attempt, from a telemetry record and its headers."""

from __future__ import annotations

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sluice.bus.base import Record
from sluice.bus.codec import encode
from sluice.bus.messages import TelemetryRecord, Timings
from sluice.bus.topics import TELEMETRY_TOPIC, Lane
from sluice.consumers.tracing.handler import TracingHandler, decode_telemetry
from sluice.consumers.tracing.spans import emit_attempt_spans
from sluice.tracing.propagation import inject_headers
from sluice.tracing.spans import tracer
from tests.unit.tracing.memory_spans import one, parent_of, span_id, trace_id

T0 = 1_700_000_000_000


def record(**fields: object) -> TelemetryRecord:
    values: dict[str, object] = {
        "request_id": "req_abc",
        "attempt": 0,
        "tenant_id": "acme",
        "model": "tiny",
        "lane": Lane.INTERACTIVE,
        "worker_id": "w1",
        "timings": Timings(
            queued_ms=T0,
            received_ms=T0 + 3,
            admitted_ms=T0 + 4,
            scheduled_ms=T0 + 6,
            first_token_ms=T0 + 20,
            finished_ms=T0 + 90,
        ),
        "num_prompt_tokens": 12,
        "num_output_tokens": 7,
        "num_cached_tokens": 4,
        "max_tokens": 32,
        "finish_reason": "length",
        "batch_id": "batch_1",
    }
    values.update(fields)
    return TelemetryRecord(**values)  # type: ignore[arg-type]


def send_headers(operation: str | None = "chat") -> tuple[trace.Span, list[tuple[str, bytes]]]:
    """A stand-in for the gateway's send span, its context (and operation) in headers."""
    span = tracer().start_span("send sluice.requests.tiny.interactive.v1", kind=SpanKind.PRODUCER)
    ctx = trace.set_span_in_context(span)
    if operation is not None:
        ctx = baggage.set_baggage("gen_ai.operation.name", operation, ctx)
    headers = inject_headers(ctx=ctx)
    span.end()
    return span, headers


def engine_side(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.kind != SpanKind.PRODUCER]


def test_one_attempt_is_a_process_subtree_under_the_send_span(
    spans: InMemorySpanExporter,
) -> None:
    send, headers = send_headers()
    emit_attempt_spans(record(), headers)
    done = spans.get_finished_spans()
    process = one(done, "process sluice.requests.tiny.interactive.v1")
    chat = one(done, "chat tiny")

    assert len(engine_side(spans)) == 2  # the phases are events, not spans of their own
    assert process.kind == SpanKind.CONSUMER and chat.kind == SpanKind.INTERNAL
    assert parent_of(process) == send.get_span_context().span_id
    assert {trace_id(s) for s in done} == {send.get_span_context().trace_id}
    assert parent_of(chat) == span_id(process)

    ns = 1_000_000
    assert (process.start_time, process.end_time) == (T0 * ns, (T0 + 90) * ns)
    assert [(e.name, e.timestamp) for e in process.events] == [
        ("received", (T0 + 3) * ns),
        ("admitted", (T0 + 4) * ns),
        ("scheduled", (T0 + 6) * ns),
    ]
    assert (chat.start_time, chat.end_time) == ((T0 + 6) * ns, (T0 + 90) * ns)
    assert [(e.name, e.timestamp) for e in chat.events] == [("first_token", (T0 + 20) * ns)]

    assert dict(process.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": "sluice.requests.tiny.interactive.v1",
        "messaging.kafka.message.key": "acme",
        "sluice.request_id": "req_abc",
        "sluice.tenant_id": "acme",
        "sluice.lane": "interactive",
        "sluice.attempt": 0,
        "sluice.batch_id": "batch_1",
        "sluice.worker_id": "w1",
        "sluice.latency.queue": 0.003,
        "sluice.latency.admission": 0.003,
    }
    attrs = dict(chat.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "sluice"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 32
    assert attrs["gen_ai.usage.input_tokens"] == 12
    assert attrs["gen_ai.usage.output_tokens"] == 7
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 4
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["sluice.attempt"] == 0 and attrs["sluice.lane"] == "interactive"
    assert attrs["gen_ai.latency.time_in_queue"] == 0.006
    assert attrs["gen_ai.latency.time_to_first_token"] == 0.020
    assert attrs["gen_ai.latency.time_in_model_prefill"] == 0.014
    assert attrs["gen_ai.latency.time_in_model_decode"] == 0.070
    assert attrs["gen_ai.latency.e2e"] == 0.090
    assert not any("message" in k and "gen_ai" in k for k in attrs)  # no content


def test_without_the_operation_it_is_a_text_completion(spans: InMemorySpanExporter) -> None:
    _, headers = send_headers(operation=None)
    emit_attempt_spans(record(), headers)
    chat = one(spans.get_finished_spans(), "text_completion tiny")
    assert (chat.attributes or {})["gen_ai.operation.name"] == "text_completion"


def test_an_attempt_answered_before_it_ran_has_no_inference_span(
    spans: InMemorySpanExporter,
) -> None:
    _, headers = send_headers()
    timings = Timings(queued_ms=T0, received_ms=T0 + 2, finished_ms=T0 + 5)
    emit_attempt_spans(record(timings=timings, finish_reason="abort"), headers)
    [process] = engine_side(spans)
    assert process.name == "process sluice.requests.tiny.interactive.v1"
    assert [e.name for e in process.events] == ["received"]
    assert (process.attributes or {})["sluice.latency.queue"] == 0.002
    assert "sluice.latency.admission" not in (process.attributes or {})


def test_an_estimated_attempt_has_a_process_and_inference_span_only(
    spans: InMemorySpanExporter,
) -> None:
    _, headers = send_headers()
    timings = Timings(queued_ms=T0, finished_ms=T0 + 500)
    estimated = record(timings=timings, estimated=True, finish_reason="error", attempt=0)
    emit_attempt_spans(estimated, headers)
    done = engine_side(spans)
    assert sorted(s.name for s in done) == [
        "chat tiny",
        "process sluice.requests.tiny.interactive.v1",
    ]
    chat = one(done, "chat tiny")
    assert (chat.attributes or {})["sluice.estimated"] is True
    assert not chat.events and not any("latency" in k for k in chat.attributes or {})
    assert chat.status.status_code == StatusCode.ERROR


def test_no_trace_context_starts_a_trace_of_its_own(spans: InMemorySpanExporter) -> None:
    emit_attempt_spans(record(), [])
    process = one(spans.get_finished_spans(), "process sluice.requests.tiny.interactive.v1")
    assert process.parent is None


def test_the_handler_skips_a_redelivered_record(spans: InMemorySpanExporter) -> None:
    _, headers = send_headers()
    value = encode(record())
    rec = Record(TELEMETRY_TOPIC, 0, 5, b"req_abc", value, headers)
    handler = TracingHandler()
    for _ in range(2):
        handler.handle(decode_telemetry(rec), rec)
    assert handler.emitted == 1
    assert len([s for s in spans.get_finished_spans() if s.name == "chat tiny"]) == 1


def test_a_record_of_before_the_new_fields_still_decodes() -> None:
    old = (
        b'{"schema_version":1,"request_id":"r","attempt":0,"tenant_id":"t","model":"m",'
        b'"lane":"standard","worker_id":"w","timings":{"queued_ms":1,"finished_ms":2},'
        b'"num_prompt_tokens":3,"num_output_tokens":4}'
    )
    message = decode_telemetry(Record(TELEMETRY_TOPIC, 0, 0, None, old, []))
    assert isinstance(message, TelemetryRecord)
    assert message.finish_reason is None and not message.estimated


def test_spans_are_not_built_outside_a_context_leak() -> None:
    # building spans attaches no context: the consumer thread's current span stays empty
    before = otel_context.get_current()
    emit_attempt_spans(record(), [])
    assert otel_context.get_current() == before
