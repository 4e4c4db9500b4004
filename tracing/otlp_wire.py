"""OTLP/protobuf encoding of finished spans, written straight to the wire format.

The SDK's exporter encodes a span by building a protobuf object per attribute, value,
event and status (`encode_spans` in opentelemetry-exporter-otlp-proto-common), the
largest single cost of tracing in a serving process (`sluice bench observability`
measures it). This module writes the same
`ExportTraceServiceRequest` bytes directly (the message equals the SDK's; a test checks
it field by field on every kind of value), and `FastOTLPSpanExporter` sends them with the
SDK's own HTTP exporter, so its endpoint, headers, compression, retries and metrics are
the SDK's.

Wire format: https://protobuf.dev/programming-guides/encoding/; message layout:
opentelemetry-proto's `trace/v1/trace.proto` and `common/v1/common.proto`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind

logger = logging.getLogger(__name__)

# Span.flags: the SDK's encoder always says whether the parent is remote
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_KIND = {  # SDK SpanKind → proto's (which starts at UNSPECIFIED = 0)
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len(tag: tuple[int, int], payload: bytes) -> bytes:
    """A length-delimited field: tag byte(s), length, payload."""
    return _TAGS[tag] + _varint(len(payload)) + payload


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


# the (field, wire type) pairs used below, each tag encoded once
_TAGS = {(f, w): _tag(f, w) for f in range(1, 17) for w in (0, 1, 2, 5)}


def _value(value: Any) -> bytes:
    """An AnyValue's fields (oneof: set even at its default)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _len((1, 2), value.encode())
    if isinstance(value, int):
        return _TAGS[3, 0] + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return _TAGS[4, 1] + _DOUBLE(value)
    if isinstance(value, bytes):
        return _len((7, 2), value)
    if isinstance(value, Sequence):
        return _len((5, 2), b"".join(_len((1, 2), _value(v)) for v in value))
    if isinstance(value, Mapping):
        return _len((6, 2), b"".join(_len((1, 2), _key_value(str(k), v)) for k, v in value.items()))
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    kv_value = _value(value)
    key_bytes = key.encode()
    return (
        _TAGS[1, 2] + _varint(len(key_bytes)) + key_bytes
        + _TAGS[2, 2] + _varint(len(kv_value)) + kv_value
    )  # fmt: skip


# Encoded attributes by (field, key, value type, value): most of a span's attributes
# repeat from span to span (operation, topic, model, tenant, lane). Cleared when full,
# as unique values (request ids, timings) fill it.
_ENCODED: dict[tuple[int, str, type, Any], bytes] = {}
_ENCODED_MAX = 8192
_CACHED_TYPES = (str, bool, int, float)


def _attributes(field: int, attributes: Mapping[str, Any] | None) -> bytes:
    if not attributes:
        return b""
    out = []
    cache = _ENCODED
    for key, value in attributes.items():
        kind = type(value)
        cacheable = kind in _CACHED_TYPES
        if cacheable:
            encoded = cache.get((field, key, kind, value))
            if encoded is not None:
                out.append(encoded)
                continue
        try:
            kv = _key_value(key, value)
        except Exception:  # as the SDK's encoder does: the attribute is left out
            logger.exception("span attribute %s not encoded", key)
            continue
        encoded = _TAGS[field, 2] + _varint(len(kv)) + kv
        if cacheable:
            if len(cache) >= _ENCODED_MAX:
                cache.clear()
            cache[field, key, kind, value] = encoded
        out.append(encoded)
    return b"".join(out)


def _uint(field: int, n: int) -> bytes:
    return _TAGS[field, 0] + _varint(n) if n else b""


def _string(field: int, s: str | None) -> bytes:
    return _len((field, 2), s.encode()) if s else b""


def _flags(parent: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)


_UNSET_STATUS = _TAGS[15, 2] + b"\x00"  # the SDK always sends a status, if empty
_LOCAL_PARENT = _TAGS[16, 5] + _FIXED32(_HAS_IS_REMOTE)
_REMOTE_PARENT = _TAGS[16, 5] + _FIXED32(_HAS_IS_REMOTE | _IS_REMOTE)


def encode_span(span: ReadableSpan) -> bytes:
    """One `Span` message."""
    context = span.get_span_context()
    assert context is not None  # a finished SDK span has its context
    parent = span.parent
    out = [
        _len((1, 2), context.trace_id.to_bytes(16, "big")),
        _len((2, 2), context.span_id.to_bytes(8, "big")),
    ]
    if context.trace_state is not None:
        out.append(_string(3, ",".join(f"{k}={v}" for k, v in context.trace_state.items())))
    if parent:
        out.append(_len((4, 2), parent.span_id.to_bytes(8, "big")))
    out.append(_string(5, span.name))
    out.append(_uint(6, _KIND[span.kind]))
    if span.start_time:
        out.append(_TAGS[7, 1] + _FIXED64(span.start_time))
    if span.end_time:
        out.append(_TAGS[8, 1] + _FIXED64(span.end_time))
    out.append(_attributes(9, span.attributes))
    out.append(_uint(10, span.dropped_attributes))
    for event in span.events:
        body = b"".join(
            (
                _TAGS[1, 1] + _FIXED64(event.timestamp) if event.timestamp else b"",
                _string(2, event.name),
                _attributes(3, event.attributes),
                _uint(4, event.dropped_attributes),
            )
        )
        out.append(_len((11, 2), body))
    out.append(_uint(12, span.dropped_events))
    for link in span.links:
        body = b"".join(
            (
                _len((1, 2), link.context.trace_id.to_bytes(16, "big")),
                _len((2, 2), link.context.span_id.to_bytes(8, "big")),
                _attributes(4, link.attributes),
                _uint(5, link.dropped_attributes),
                _TAGS[6, 5] + _FIXED32(_flags(link.context)),
            )
        )
        out.append(_len((13, 2), body))
    out.append(_uint(14, span.dropped_links))
    status = span.status
    if status.description or status.status_code.value:
        out.append(
            _len((15, 2), _string(2, status.description) + _uint(3, status.status_code.value))
        )
    else:
        out.append(_UNSET_STATUS)
    out.append(_REMOTE_PARENT if parent is not None and parent.is_remote else _LOCAL_PARENT)
    return b"".join(out)


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """An `ExportTraceServiceRequest`: the spans grouped by resource, then by scope."""
    # grouped as the SDK's encoder groups them (equal resources are one), found by
    # identity first: Resource's hash serializes its attributes to JSON
    grouped: list[tuple[Resource, dict[Any, list[bytes]]]] = []
    last: tuple[Resource, dict[Any, list[bytes]]] | None = None
    for span in spans:
        resource = span.resource
        if last is None or last[0] is not resource:
            last = next((g for g in grouped if g[0] is resource), None) or next(
                (g for g in grouped if g[0] == resource), None
            )
            if last is None:
                last = (resource, {})
                grouped.append(last)
        last[1].setdefault(span.instrumentation_scope or None, []).append(encode_span(span))
    out = []
    for resource, scopes in grouped:
        body = [_len((1, 2), _attributes(1, resource.attributes))]
        for scope, encoded in scopes.items():
            if scope is None:
                head = _len((1, 2), b"")
            else:
                head = _len(
                    (1, 2),
                    _string(1, scope.name)
                    + _string(2, scope.version)
                    + _attributes(3, scope.attributes),
                )
            spans_part = b"".join(_len((2, 2), s) for s in encoded)
            schema = _string(3, scope.schema_url) if scope is not None else b""
            body.append(_len((2, 2), head + spans_part + schema))
        body.append(_string(3, resource.schema_url))
        out.append(_len((1, 2), b"".join(body)))
    return b"".join(out)


class _PreEncoded(list[ReadableSpan]):
    """Spans with their request bytes: what `FastOTLPSpanExporter` hands the SDK's
    export, and what its encoder (see `_install`) then returns as is. Were an SDK to
    encode some other way, it would encode these spans itself: they are a list."""

    def __init__(self, spans: Sequence[ReadableSpan], data: bytes) -> None:
        super().__init__(spans)
        self.data = data

    def SerializePartialToString(self) -> bytes:
        return self.data


def _install() -> None:
    """Have the SDK's HTTP exporter take pre-encoded spans as they are. Its `export`
    looks its module's `encode_spans` up per call; any other caller's spans still go to
    the SDK's encoder."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    sdk_encode = trace_exporter.encode_spans  # type: ignore[attr-defined]
    if getattr(sdk_encode, "sluice_passes_pre_encoded", False):
        return

    def encode(spans: Sequence[ReadableSpan]) -> Any:
        return spans if isinstance(spans, _PreEncoded) else sdk_encode(spans)

    encode.sluice_passes_pre_encoded = True  # type: ignore[attr-defined]
    trace_exporter.encode_spans = encode  # type: ignore[attr-defined,assignment]


class FastOTLPSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter with `encode_spans` of this module: everything
    but the encoding (endpoint, headers, compression, retries, its metrics) is the SDK's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _install()
        super().__init__(*args, **kwargs)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            data = encode_spans(spans)
        except Exception:  # an encoder bug must not lose the spans: the SDK's encodes them
            logger.exception("span encoding failed; the SDK's encoder takes this batch")
            return super().export(spans)
        return super().export(_PreEncoded(spans, data))
