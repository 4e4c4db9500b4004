"""Trace context in Kafka headers: inject on publish, extract on consume.

W3C `traceparent`/`tracestate` through OpenTelemetry's global propagator, so a request's
spans in the gateway, the engine worker and the side consumers join one trace. Telemetry
never breaks the request: a bad header yields an empty context.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.propagators.textmap import Getter, Setter

Headers = list[tuple[str, bytes]]


class _HeaderSetter(Setter[Headers]):
    def set(self, carrier: Headers, key: str, value: str) -> None:
        carrier[:] = [(k, v) for k, v in carrier if k != key]
        carrier.append((key, value.encode()))


class _HeaderGetter(Getter[Headers]):
    def get(self, carrier: Headers, key: str) -> list[str] | None:
        values = [v.decode(errors="replace") for k, v in carrier if k == key]
        return values or None

    def keys(self, carrier: Headers) -> list[str]:
        return [k for k, _ in carrier]


_SETTER = _HeaderSetter()
_GETTER = _HeaderGetter()


def inject_headers(
    headers: Headers | None = None, ctx: otel_context.Context | None = None
) -> Headers:
    """Return `headers` (a new list if None) with the current trace context added."""
    carrier: Headers = list(headers or [])
    propagate.inject(carrier, context=ctx, setter=_SETTER)
    return carrier


def extract_context(headers: Headers) -> otel_context.Context:
    """The trace context carried by a record's headers (empty when there is none)."""
    try:
        return propagate.extract(headers, getter=_GETTER)
    except Exception:  # a malformed header must not fail the message
        return otel_context.Context()


def trace_headers(headers: Headers) -> Headers:
    """Only the trace-context headers of `headers` (`traceparent`, `tracestate`,
    `baggage`: the global propagator's fields), to copy onto a record that follows."""
    fields = propagate.get_global_textmap().fields
    return [(k, v) for k, v in headers if k in fields]
