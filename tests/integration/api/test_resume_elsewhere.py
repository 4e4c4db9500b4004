"""Resuming a stream on another gateway than the one that ran it: two gateways on one
memory bus and one directory of streams, the fake engine worker behind them, real
loopback servers; raw SSE through httpx, the reference through the `openai` SDK.
(The same with kill -9 on Kafka: `tests/e2e/test_resume_kafka.py`.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.storage.streams import MemoryStreamDirectory
from tests.integration.api.test_resume import (
    HEADERS,
    REPLY,
    Sse,
    _chat_body,
    _chat_text,
    _post,
    _reference_chat,
    _usage,
)
from tests.unit.api.conftest import gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model


@dataclass
class Pair:
    first: str  # base URLs
    other: str
    engine: FakeEngineWorker


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=2, pools=("tiny",)).specs())
    engine = FakeEngineWorker(bus, reply=REPLY, step_s=0.005).start()
    directory = MemoryStreamDirectory()
    apps = []
    for _ in range(2):
        app = create_app(
            gateway_settings(stream_resume_window_s=30.0), bus, [served_model("tiny", 1024)]
        )
        app.state.gateway.service.streams.directory = directory
        apps.append(app)
    with ServerThread(apps[0]) as first, ServerThread(apps[1]) as other:
        yield Pair(first.base_url, other.base_url, engine)
    engine.stop()
    bus.close()


@pytest.fixture
def gateways(pair: Pair) -> Pair:
    pair.engine.requests[:], pair.engine.cancels[:] = [], []
    return pair


def test_a_chat_stream_resumed_on_another_gateway_equals_an_uninterrupted_run(
    gateways: Pair,
) -> None:
    reference, reference_tokens = _reference_chat(gateways.first, 200)
    gateways.engine.requests[:] = []

    first = _post(gateways.first, "/v1/chat/completions", _chat_body(), Sse(), stop_after=12)
    rest = _post(
        gateways.other, "/v1/chat/completions", _chat_body(), Sse(), last_event_id=first.last_id
    )

    chunks = first.chunks() + rest.chunks()
    assert _chat_text(chunks) == reference
    assert _usage(chunks)["completion_tokens"] == reference_tokens
    assert rest.data[-1] == "[DONE]"
    assert not set(first.ids) & set(rest.ids), "an event came twice"
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert len(gateways.engine.requests) == 1, "a resume is not a new request"
    assert not gateways.engine.cancels


def test_completions_with_two_choices_resume_on_another_gateway(gateways: Pair) -> None:
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 150, "n": 2, "stream": True}
    first = _post(gateways.first, "/v1/completions", body, Sse(), stop_after=25)
    rest = _post(gateways.other, "/v1/completions", body, Sse(), last_event_id=first.last_id)
    chunks = first.chunks() + rest.chunks()
    for index in (0, 1):
        text = "".join(c["text"] for ch in chunks for c in ch["choices"] if c["index"] == index)
        assert text == REPLY[:150]
    assert len(gateways.engine.requests) == 2  # one per choice, none again


def test_a_stream_taken_over_can_be_resumed_again_on_its_first_gateway(gateways: Pair) -> None:
    first = _post(gateways.first, "/v1/chat/completions", _chat_body(), Sse(), stop_after=5)
    second = _post(
        gateways.other,
        "/v1/chat/completions",
        _chat_body(),
        Sse(),
        stop_after=5,
        last_event_id=first.last_id,
    )
    rest = _post(
        gateways.first, "/v1/chat/completions", _chat_body(), Sse(), last_event_id=second.last_id
    )
    chunks = first.chunks() + second.chunks() + rest.chunks()
    assert _chat_text(chunks) == REPLY[:200]
    assert len(gateways.engine.requests) == 1


def test_a_resume_elsewhere_of_another_request_or_unknown_stream_is_refused(
    gateways: Pair,
) -> None:
    first = _post(gateways.first, "/v1/chat/completions", _chat_body(), Sse(), stop_after=3)
    url = gateways.other + "/v1/chat/completions"
    headers = {**HEADERS, "Last-Event-ID": first.last_id}
    other = httpx.post(url, json={**_chat_body(), "max_tokens": 199}, headers=headers, timeout=30)
    assert other.status_code == 400, other.text
    assert other.json()["error"]["param"] == "Last-Event-ID"
    unknown = {**HEADERS, "Last-Event-ID": "nosuchcall:3:1"}
    gone = httpx.post(url, json=_chat_body(), headers=unknown, timeout=30)
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == "stream_not_found"
