"""One streamed request is one trace: the gateway's server and send spans, then the
tracing consumer's engine-side spans, over the memory bus with a real engine worker."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sluice.api.app import create_app
from sluice.bus.codec import decode_as
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC
from sluice.consumers.loop import ConsumeLoop
from sluice.consumers.tracing.handler import tracing_loop
from sluice.settings import GatewaySettings
from tests.unit.api.fakes import served_model
from tests.unit.consumers.engine_harness import WorkerThread, create_topics
from tests.unit.tracing.memory_spans import by_name, one, parent_of, span_id, trace_id
from tests.waiting import wait_until

API_KEY = "sk-test-key"
TOPIC = "sluice.requests.tiny.standard.v1"


@pytest.fixture
def bus() -> Iterator[MemoryEventBus]:
    bus = MemoryEventBus()
    create_topics(bus, pools=("tiny",))
    yield bus
    bus.close()


@pytest.fixture
def tracing(bus: MemoryEventBus) -> Iterator[ConsumeLoop]:
    loop = tracing_loop(bus)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    yield loop
    loop.stop()
    thread.join(5)


@pytest.fixture
def client(bus: MemoryEventBus, tracing: ConsumeLoop) -> Iterator[TestClient]:
    worker = WorkerThread(bus, pool="tiny").start()
    settings = GatewaySettings(api_keys=[API_KEY], request_timeout_s=30.0)  # type: ignore[call-arg]
    app = create_app(settings, bus, [served_model("tiny", max_model_len=256)])
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
    worker.stop()


def sse_usage(text: str) -> dict[str, Any]:
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {")
    ]
    usage: dict[str, Any] = chunks[-1]["usage"]
    return usage


def wait_for(spans: InMemorySpanExporter, name: str, count: int = 1) -> list[ReadableSpan]:
    wait_until(lambda: len(by_name(spans.get_finished_spans(), name)) >= count, 10, f"{name} span")
    return list(spans.get_finished_spans())


def usage_records(bus: MemoryEventBus) -> list[UsageRecord]:
    consumer = bus.consumer("test-usage", [USAGE_TOPIC])
    try:
        return [decode_as(UsageRecord, r.value) for r in consumer.poll(0.5, 100)]
    finally:
        consumer.close()


def test_a_streamed_chat_request_is_one_trace(
    client: TestClient, bus: MemoryEventBus, spans: InMemorySpanExporter
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    usage = sse_usage(r.text)
    done = wait_for(spans, "chat tiny")

    server = one(done, "POST /v1/chat/completions")
    send = one(done, f"send {TOPIC}")
    process = one(done, f"process {TOPIC}")
    chat = one(done, "chat tiny")
    assert server.kind == SpanKind.SERVER and send.kind == SpanKind.PRODUCER
    assert process.kind == SpanKind.CONSUMER and chat.kind == SpanKind.INTERNAL
    assert server.parent is None
    assert parent_of(send) == span_id(server)
    assert parent_of(process) == span_id(send)
    assert parent_of(chat) == span_id(process)
    assert [e.name for e in process.events] == ["received", "admitted", "scheduled"]
    assert [e.name for e in chat.events] == ["first_token"]
    assert len({trace_id(s) for s in done}) == 1

    request_id = r.headers["x-request-id"]
    [record] = [u for u in usage_records(bus) if u.request_id == request_id]
    attrs = dict(chat.attributes or {})
    assert attrs["gen_ai.usage.input_tokens"] == record.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == record.completion_tokens == 9
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == record.cached_tokens
    assert attrs["gen_ai.response.finish_reasons"] == (record.finish_reason,)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 9
    assert attrs["sluice.tenant_id"] == record.tenant_id
    assert attrs["sluice.lane"] == "standard" and attrs["sluice.attempt"] == 0

    sent = dict(send.attributes or {})
    assert sent["messaging.system"] == "kafka"
    assert sent["messaging.destination.name"] == TOPIC
    assert sent["messaging.kafka.message.key"] == record.tenant_id
    assert "messaging.destination.partition.id" in sent

    served = dict(server.attributes or {})
    assert served["http.response.status_code"] == 200
    assert served["http.route"] == "/v1/chat/completions"
    assert served["sluice.request_id"] == request_id
    assert served["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == record.prompt_tokens
    assert served["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert server.end_time is not None and chat.end_time is not None
    assert server.end_time >= chat.end_time  # the server span ends with the stream
    assert not any("Hi" in str(v) for s in done for v in (s.attributes or {}).values())


def test_a_completion_is_a_text_completion_and_health_checks_are_not_traced(
    client: TestClient, spans: InMemorySpanExporter
) -> None:
    assert client.get("/healthz").status_code == 200
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3})
    assert r.status_code == 200, r.text
    done = wait_for(spans, "text_completion tiny")
    assert not [s for s in done if "healthz" in s.name]
    server = one(done, "POST /v1/completions")
    assert (server.attributes or {})["gen_ai.operation.name"] == "text_completion"
