"""Prompts and outputs reach the server span only where `trace_content` opts in."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.settings import GatewaySettings
from tests.unit.api.fakes import FakeEngineWorker, served_model
from tests.unit.tracing.memory_spans import one

API_KEY = "sk-test-key"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}]}


def client_for(trace_content: bool) -> Iterator[TestClient]:
    bus = MemoryEventBus()
    bus.create_topics(
        TopicLayout(request_partitions=1, tokens_partitions=1, pools=("tiny",)).specs()
    )
    engine = FakeEngineWorker(bus).start()
    settings = GatewaySettings(api_keys=[API_KEY], trace_content=trace_content)  # type: ignore[call-arg]
    app = create_app(settings, bus, [served_model("tiny")])
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
    engine.stop()
    bus.close()


@pytest.fixture
def opted_in() -> Iterator[TestClient]:
    yield from client_for(True)


@pytest.fixture
def default() -> Iterator[TestClient]:
    yield from client_for(False)


@pytest.mark.parametrize("stream", [False, True])
def test_opted_in_the_server_span_carries_the_messages(
    opted_in: TestClient, spans: InMemorySpanExporter, stream: bool
) -> None:
    r = opted_in.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 200, r.text
    attrs = one(spans.get_finished_spans(), "POST /v1/chat/completions").attributes or {}
    inputs = json.loads(str(attrs["gen_ai.input.messages"]))
    outputs = json.loads(str(attrs["gen_ai.output.messages"]))
    assert inputs == [{"role": "user", "parts": [{"type": "text", "content": "Hi there"}]}]
    assert outputs == [{"role": "assistant", "parts": [{"type": "text", "content": "Hello world"}]}]


def test_a_completion_prompt_is_the_input(
    opted_in: TestClient, spans: InMemorySpanExporter
) -> None:
    r = opted_in.post("/v1/completions", json={"model": "tiny", "prompt": "Once"})
    assert r.status_code == 200, r.text
    attrs = one(spans.get_finished_spans(), "POST /v1/completions").attributes or {}
    assert json.loads(str(attrs["gen_ai.input.messages"]))[0]["parts"][0]["content"] == "Once"
    assert "Hello world" in str(attrs["gen_ai.output.messages"])


def test_by_default_no_span_carries_text(default: TestClient, spans: InMemorySpanExporter) -> None:
    r = default.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200, r.text
    for span in spans.get_finished_spans():
        values = " ".join(str(v) for v in (span.attributes or {}).values())
        assert "Hi there" not in values and "Hello world" not in values
