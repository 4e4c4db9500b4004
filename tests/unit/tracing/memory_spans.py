"""Spans of the test process, kept in memory: one exporter on the global provider.

OpenTelemetry's global TracerProvider can be set once per process, so the first test
that needs spans installs an SDK provider with an `InMemorySpanExporter`, and every
later one clears and reuses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter: InMemorySpanExporter | None = None


def memory_exporter() -> InMemorySpanExporter:
    global _exporter
    if _exporter is None:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        _exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
    return _exporter


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = memory_exporter()
    exporter.clear()
    yield exporter
    exporter.clear()


def by_name(finished: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def one(finished: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = by_name(finished, name)
    assert len(found) == 1, f"{name}: {[s.name for s in finished]}"
    return found[0]


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id
