"""`tracing.otlp_wire` writes the message the SDK's OTLP encoder builds, for every kind
of attribute value, events, links, statuses, parents local and remote, several resources
and scopes; its exporter sends those bytes through the SDK's HTTP exporter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from sluice.tracing.otlp_wire import FastOTLPSpanExporter, encode_spans

VALUES = {
    "s": "text ünïcode",
    "empty": "",
    "yes": True,
    "no": False,
    "zero": 0,
    "int": 42,
    "big": 2**62,
    "negative": -7,
    "float": 0.125,
    "float_zero": 0.0,
    "strings": ["stop", "length"],
    "ints": [1, -2, 3],
    "bools": [True, False],
    "floats": [1.5, -0.25],
    "no_items": [],
}


def _spans(resource: Resource, scope: str, version: str | None = None) -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(scope, version, schema_url="https://example.com/schema")
    remote = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "value"), ("other", "x")]),
    )
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with tracer.start_as_current_span(
        "server", context=parent, kind=SpanKind.SERVER, attributes=VALUES
    ) as root:
        root.add_event("first_token", {"n": 1, "tokens": [3, 4]}, timestamp=1_700_000_000_123)
        root.add_event("bare")
        child = tracer.start_span(
            "child",
            kind=SpanKind.CONSUMER,
            links=[Link(remote, {"why": "batch"}), Link(root.get_span_context())],
            start_time=1_700_000_000_000_000_000,
        )
        child.set_status(Status(StatusCode.ERROR, "the engine failed"))
        child.end(end_time=1_700_000_000_500_000_000)
        for kind in (SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.PRODUCER):
            tracer.start_span(kind.name.lower(), kind=kind).end()
        ok = tracer.start_span("ok")
        ok.set_status(Status(StatusCode.OK))
        ok.end()
    return list(memory.get_finished_spans())


def test_the_request_equals_the_sdk_encoders() -> None:
    spans = _spans(Resource.create({"service.name": "a", "n": 3}), "sluice", "1.0")
    spans += _spans(Resource.create({"service.name": "a", "n": 3}), "other")
    spans += _spans(Resource({"service.name": "b"}, schema_url="https://example.com/r"), "x")
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    theirs = sdk_encode(spans)
    assert ours == theirs
    # equal resources are one group
    assert len(ours.resource_spans) == 2 and len(ours.resource_spans[0].scope_spans) == 2
    # the same bytes, field for field (`==` on messages compares what they hold)
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(
        deterministic=True
    )


def test_no_spans_is_an_empty_request() -> None:
    assert encode_spans([]) == b""


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("fast", [True, False], ids=["ours", "the SDK's alongside ours"])
def test_the_exporter_posts_the_encoded_request(
    receiver: tuple[str, list[bytes]], fast: bool
) -> None:
    """Ours posts the request it encoded; the SDK's own exporter, once ours is installed,
    still encodes for itself."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url, bodies = receiver
    FastOTLPSpanExporter(endpoint=url).shutdown()  # installed either way
    spans = _spans(Resource.create({"service.name": "a"}), "sluice")
    exporter = FastOTLPSpanExporter(endpoint=url) if fast else OTLPSpanExporter(endpoint=url)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert [ExportTraceServiceRequest.FromString(b) for b in bodies] == [sdk_encode(spans)]
