"""Span names and attributes: one place for the OpenTelemetry conventions Sluice emits.

The gateway's server and `send` spans and the tracing consumer's engine-side spans take
their names and attribute keys from here, so a renamed convention changes in one file.
We follow the GenAI and messaging semantic conventions of schema 1.44.0, as shipped in
`opentelemetry-semantic-conventions` 0.66b2 (`SEMCONV_VERSION`); both are still marked
Development, so their names may move: pinned here, and every tracer says which version
its spans carry (`SCHEMA_URL`). No prompt or output text goes into a span.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from sluice.tracing.propagation import Headers, inject_headers

logger = logging.getLogger(__name__)

# the conventions (and their schema) these names follow; see the module docstring
SEMCONV_VERSION = "1.44.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
INSTRUMENTATION = "sluice"

GenAIOperation = Literal["chat", "text_completion"]
PROVIDER = "sluice"  # `gen_ai.provider.name`: a custom value is allowed, we are the server

# events on the engine-side spans built by the tracing consumer (consumers/tracing/)
RECEIVED_EVENT = "received"  # an engine worker polled the request (the bus queue ends)
ADMITTED_EVENT = "admitted"  # the worker's fair queue let it in
SCHEDULED_EVENT = "scheduled"  # submitted to the engine (the worker's admission ends)
FIRST_TOKEN_EVENT = "first_token"  # the engine's first token (prefill ends)

# attribute keys
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_OPERATION_NAME = "messaging.operation.name"
MESSAGING_OPERATION_TYPE = "messaging.operation.type"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_PARTITION = "messaging.destination.partition.id"
MESSAGING_KAFKA_KEY = "messaging.kafka.message.key"
MESSAGING_KAFKA_OFFSET = "messaging.kafka.offset"
MESSAGING_CONSUMER_GROUP = "messaging.consumer.group.name"
MESSAGING_BATCH_COUNT = "messaging.batch.message_count"
TENANT_ID = "sluice.tenant_id"
REQUEST_ID = "sluice.request_id"
LANE = "sluice.lane"
ATTEMPT = "sluice.attempt"
BATCH_ID = "sluice.batch_id"
WORKER_ID = "sluice.worker_id"
ESTIMATED = "sluice.estimated"
ATTEMPTS = "sluice.attempts"
# where an attempt's time went, in seconds: on `process`, the bus queue and the worker's
# admission; on the inference span vLLM's names (its `llm_request` span has them)
QUEUE_SECONDS = "sluice.latency.queue"
ADMISSION_SECONDS = "sluice.latency.admission"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"  # request built → engine submit
LATENCY_TTFT = "gen_ai.latency.time_to_first_token"  # request built → first token
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"  # engine submit → first token
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"  # first token → finished
LATENCY_E2E = "gen_ai.latency.e2e"  # request built → finished


@functools.cache
def tracer() -> trace.Tracer:
    """Sluice's tracer on the global provider (a no-op one until `configure_tracing`).
    Kept once per process: one taken before the provider is set follows it there."""
    return trace.get_tracer(INSTRUMENTATION, schema_url=SCHEMA_URL)


def inference_span_name(operation: str, model: str) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, e.g. `chat tiny-llama`."""
    return f"{operation} {model}"


def send_span_name(topic: str) -> str:
    return f"send {topic}"


def process_span_name(topic: str) -> str:
    return f"process {topic}"


def kafka_attributes(
    operation: Literal["send", "process"],
    topic: str,
    *,
    key: bytes | str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    group: str | None = None,
) -> dict[str, AttributeValue]:
    """The messaging attributes of one single-message Kafka span (`send` or `process`)."""
    attrs: dict[str, AttributeValue] = {
        MESSAGING_SYSTEM: "kafka",
        MESSAGING_OPERATION_NAME: operation,
        MESSAGING_OPERATION_TYPE: operation,
        MESSAGING_DESTINATION: topic,
    }
    if key is not None:
        attrs[MESSAGING_KAFKA_KEY] = key.decode(errors="replace") if isinstance(key, bytes) else key
    if partition is not None:
        attrs[MESSAGING_PARTITION] = str(partition)
    if offset is not None:
        attrs[MESSAGING_KAFKA_OFFSET] = offset
    if group is not None:
        attrs[MESSAGING_CONSUMER_GROUP] = group
    return attrs


def usage_attributes(
    input_tokens: int, output_tokens: int, cached_tokens: int
) -> dict[str, AttributeValue]:
    """`gen_ai.usage.*`: billable tokens, as the usage records and the response count them."""
    return {
        GEN_AI_INPUT_TOKENS: input_tokens,
        GEN_AI_OUTPUT_TOKENS: output_tokens,
        GEN_AI_CACHE_READ_TOKENS: cached_tokens,
    }


def without_none(attrs: Mapping[str, AttributeValue | None]) -> dict[str, AttributeValue]:
    """The attributes that have a value (OpenTelemetry drops None with a warning)."""
    return {k: v for k, v in attrs.items() if v is not None}


class SendSpan:
    """The PRODUCER `send <topic>` span of one publish call (the records of one HTTP call
    go to one lane's topic): a child of the current span, its context in the records'
    headers (`headers`), ended when the broker confirmed every record or failed one. A
    batch line's (`batch_id`) is the root of the line's trace."""

    def __init__(
        self, topic: str, key: str, request_id: str, count: int = 1, batch_id: str | None = None
    ) -> None:
        attrs = kafka_attributes("send", topic, key=key if count == 1 else None)
        attrs[REQUEST_ID] = request_id
        if count > 1:
            attrs[MESSAGING_BATCH_COUNT] = count
        if batch_id is not None:
            attrs[BATCH_ID] = batch_id
        self.span = tracer().start_span(
            send_span_name(topic),
            # a batch line is a trace of its own (a batch of 50,000 lines is no one trace)
            context=otel_context.Context() if batch_id is not None else None,
            kind=trace.SpanKind.PRODUCER,
            attributes=attrs,
        )
        self._single = count == 1  # where a record landed is an attribute of its own span
        self._pending = 0
        self._lock = threading.Lock()

    def headers(self) -> Headers:
        """Record headers carrying this span's context; when it does not record (nothing
        exported here), the current context's (a client's own trace, or nothing)."""
        if not self.span.is_recording():
            return inject_headers()
        return inject_headers(ctx=trace.set_span_in_context(self.span))

    def end_when_sent(self, futures: Sequence[Future[Any]]) -> None:
        """End the span once every publish is confirmed (on the bus's thread)."""
        if not self.span.is_recording():
            return
        self._pending = len(futures)
        for future in futures:
            future.add_done_callback(self._sent)
        if not futures:
            self.span.end()

    def _sent(self, future: Future[Any]) -> None:
        try:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:200]))
                self.span.set_attribute("error.type", type(error).__name__)
            elif not future.cancelled():
                where = future.result()
                partition = getattr(where, "partition", None)
                if partition is not None and self._single:
                    self.span.set_attribute(MESSAGING_PARTITION, str(partition))
                    self.span.set_attribute(MESSAGING_KAFKA_OFFSET, where.offset)
        except Exception:  # telemetry never breaks a publish
            logger.debug("send span not completed", exc_info=True)
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.span.end()
