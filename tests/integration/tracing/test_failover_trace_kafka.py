"""A failover is one trace: worker A dies mid-stream (no drain, no commit, no usage or
telemetry of its own), worker B resumes the request as attempt 1 on a real Kafka broker,
and the tracing consumer, here in the test process with an in-memory exporter, builds
both attempts' `process` subtrees under the request's one `send` span."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sluice.bus.codec import encode
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.topics import pool_id, request_topic
from sluice.consumers.engine_worker import EngineWorkerConfig
from sluice.consumers.progress import MemoryProgressStore
from sluice.consumers.tracing.handler import tracing_loop
from sluice.tracing.spans import SendSpan, tracer
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request
from tests.unit.consumers.sim_engine import RecordingSimBackend
from tests.unit.tracing.memory_spans import parent_of, span_id, trace_id
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MAX_TOKENS = 60


@pytest.fixture
def kafka_bus(dedicated_kafka: str) -> Iterator[KafkaEventBus]:
    bus = KafkaEventBus(KafkaConfig(bootstrap=dedicated_kafka, client_id="sluice-tracing-test"))
    create_topics(bus, request_partitions=1)
    yield bus
    bus.close()


def test_both_attempts_of_a_failover_share_the_trace(
    kafka_bus: KafkaEventBus, spans: InMemorySpanExporter
) -> None:
    group = f"engine-{uuid.uuid4().hex[:8]}"
    config = EngineWorkerConfig(group_id=group, poll_timeout_s=0.05, tick_s=0.01)
    store = MemoryProgressStore()
    loop = tracing_loop(kafka_bus, group_id=f"tracing-{uuid.uuid4().hex[:8]}")
    consumer = threading.Thread(target=loop.run, daemon=True)
    consumer.start()
    client = Client(kafka_bus)
    request = make_request(f"fo-{uuid.uuid4().hex[:6]}", prompt=[5, 6, 7], max_tokens=MAX_TOKENS)
    a = WorkerThread(kafka_bus, RecordingSimBackend(step_s=0.02), config, store, "a").start(30)
    try:
        with tracer().start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER):
            topic = request_topic(request.lane, pool_id(request.model))
            send = SendSpan(topic, request.tenant_id, request.request_id)
            future = kafka_bus.publish(
                topic, encode(request), key=request.tenant_id.encode(), headers=send.headers()
            )
            send.end_when_sent([future])
            future.result(10)

        def streamed() -> int:
            stream = client.view.streams.get(request.request_id)
            return 0 if stream is None else len(stream.token_ids)

        client.wait(lambda: streamed() >= 15, 30)
        a.abandon()  # kill -9: no terminal delta, no usage, no telemetry, no commit
        b = WorkerThread(kafka_bus, RecordingSimBackend(step_s=0.002), config, store, "b")
        b.start(60)
        client.wait_finished([request.request_id], timeout_s=60)
        b.stop()
        wait_until(
            lambda: len(_inference(spans, request.request_id)) >= 2, 30, "two inference spans"
        )
    finally:
        loop.stop()
        consumer.join(10)
        client.close()

    done = spans.get_finished_spans()
    [sent] = [s for s in done if s.kind == SpanKind.PRODUCER]
    processes = sorted(
        (s for s in done if s.kind == SpanKind.CONSUMER),
        key=lambda s: s.attributes["sluice.attempt"],
    )
    assert [p.attributes["sluice.attempt"] for p in processes] == [0, 1]
    assert all(parent_of(p) == span_id(sent) for p in processes)
    inference = sorted(
        _inference(spans, request.request_id), key=lambda s: s.attributes["sluice.attempt"]
    )
    assert [parent_of(s) for s in inference] == [span_id(p) for p in processes]
    assert {trace_id(s) for s in done} == {trace_id(sent)}  # one trace
    first, second = (dict(s.attributes or {}) for s in inference)
    assert first["sluice.estimated"] is True and "sluice.estimated" not in second
    # together the attempts count the tokens the client received, as the usage records do
    billed = {
        u.attempt: u.completion_tokens for u in client.usage if u.request_id == request.request_id
    }
    assert first["gen_ai.usage.output_tokens"] == billed[0]
    assert second["gen_ai.usage.output_tokens"] == billed[1]
    assert billed[0] + billed[1] == MAX_TOKENS


def _inference(spans: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    return [
        s
        for s in spans.get_finished_spans()
        if s.kind == SpanKind.INTERNAL
        and (s.attributes or {}).get("gen_ai.response.id") == request_id
    ]
