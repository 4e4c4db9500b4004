"""Resumable streams on a real loopback server: a client whose connection dropped sends
the same request again with `Last-Event-ID` and gets exactly the events after that one.

Memory bus and the fake engine worker behind the gateway; raw SSE through httpx (the
header and the `id:` lines), the uninterrupted reference through the `openai` SDK.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from tests.sse import Events, read_events
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model
from tests.waiting import wait_until

REPLY = "".join(f"word{i} " for i in range(60))  # one character per step of the fake
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Live:
    server: ServerThread
    engine: FakeEngineWorker
    app: Any

    @property
    def base_url(self) -> str:
        return self.server.base_url


def _live(window_s: float) -> Iterator[Live]:
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=2, pools=("tiny",)).specs())
    engine = FakeEngineWorker(bus, reply=REPLY, step_s=0.005).start()
    app = create_app(
        gateway_settings(stream_resume_window_s=window_s), bus, [served_model("tiny", 1024)]
    )
    with ServerThread(app) as server:
        yield Live(server, engine, app)
    engine.stop()
    bus.close()


@pytest.fixture(scope="module")
def module_live() -> Iterator[Live]:
    yield from _live(window_s=30.0)


@pytest.fixture
def live(module_live: Live) -> Live:
    module_live.engine.requests[:], module_live.engine.cancels[:] = [], []
    return module_live


@dataclass
class Sse:
    """The events of one SSE response as a client reads them."""

    ids: list[str | None] = field(default_factory=list)
    data: list[str] = field(default_factory=list)

    @property
    def last_id(self) -> str:
        last = [i for i in self.ids if i is not None][-1]
        return last

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for d in self.data if d != "[DONE]"]


def _read(response: httpx.Response, sse: Sse, stop_after: int | None = None) -> Sse:
    """Read events into `sse`; with `stop_after`, stop once that many were read."""
    events: Events = list(zip(sse.ids, sse.data, strict=True))
    read_events(response.iter_lines(), events, stop_after)
    sse.ids[:] = [event_id for event_id, _ in events]
    sse.data[:] = [data for _, data in events]
    return sse


def _post(
    base_url: str,
    path: str,
    body: dict[str, Any],
    sse: Sse,
    stop_after: int | None = None,
    last_event_id: str | None = None,
) -> Sse:
    headers = dict(HEADERS)
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    with httpx.stream("POST", base_url + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return _read(r, sse, stop_after)


def _chat_text(chunks: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for chunk in chunks
        for c in chunk["choices"]
        if c["index"] == index
    )


def _usage(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    [usage] = [c["usage"] for c in chunks if c.get("usage")]
    return usage


def _chat_body(max_tokens: int = 200) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _reference_chat(base_url: str, max_tokens: int) -> tuple[str, int]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, completion_tokens = "", 0
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
    return text, completion_tokens


def test_every_stream_event_carries_an_id(live: Live) -> None:
    sse = _post(live.base_url, "/v1/chat/completions", _chat_body(20), Sse())
    assert all(i is not None for i in sse.ids)
    assert len(set(sse.ids)) == len(sse.ids)  # each one names its own position
    assert sse.data[-1] == "[DONE]"


def test_chat_resumed_after_a_dropped_connection_equals_an_uninterrupted_run(
    live: Live,
) -> None:
    reference, reference_tokens = _reference_chat(live.base_url, 200)
    live.engine.requests[:] = []

    first = _post(live.base_url, "/v1/chat/completions", _chat_body(), Sse(), stop_after=12)
    rest = _post(
        live.base_url, "/v1/chat/completions", _chat_body(), Sse(), last_event_id=first.last_id
    )

    chunks = first.chunks() + rest.chunks()
    assert _chat_text(chunks) == reference
    assert _usage(chunks)["completion_tokens"] == reference_tokens
    assert rest.data[-1] == "[DONE]"
    assert not set(first.ids) & set(rest.ids), "an event came twice"
    assert len(live.engine.requests) == 1, "a resume is not a new request"
    assert not live.engine.cancels


def test_a_stream_resumed_after_its_generation_ended_gets_the_rest(live: Live) -> None:
    first = _post(live.base_url, "/v1/chat/completions", _chat_body(40), Sse(), stop_after=3)
    wait_until(lambda: not live.engine._active, 10, "the generation to end at the engine")
    rest = _post(
        live.base_url, "/v1/chat/completions", _chat_body(40), Sse(), last_event_id=first.last_id
    )
    chunks = first.chunks() + rest.chunks()
    assert _chat_text(chunks) == REPLY[:40]
    assert _usage(chunks)["completion_tokens"] == 40


def test_completions_with_two_choices_resume_each_choice(live: Live) -> None:
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 150, "n": 2, "stream": True}
    first = _post(live.base_url, "/v1/completions", body, Sse(), stop_after=25)
    rest = _post(live.base_url, "/v1/completions", body, Sse(), last_event_id=first.last_id)
    chunks = first.chunks() + rest.chunks()
    for index in (0, 1):
        text = "".join(c["text"] for ch in chunks for c in ch["choices"] if c["index"] == index)
        assert text == REPLY[:150]
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert finishes == ["length", "length"]
    assert len(live.engine.requests) == 2  # one per choice, none again


def test_a_resume_must_ask_the_same_request(live: Live) -> None:
    first = _post(live.base_url, "/v1/chat/completions", _chat_body(), Sse(), stop_after=3)
    other = {**_chat_body(), "max_tokens": 199}
    headers = {**HEADERS, "Last-Event-ID": first.last_id}
    r = httpx.post(live.base_url + "/v1/chat/completions", json=other, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "Last-Event-ID"
    # the stream is still there for the right request
    rest = _post(
        live.base_url, "/v1/chat/completions", _chat_body(), Sse(), last_event_id=first.last_id
    )
    assert _chat_text(first.chunks() + rest.chunks()) == REPLY[:200]


def test_an_unknown_or_malformed_event_id_is_refused(live: Live) -> None:
    url = live.base_url + "/v1/chat/completions"
    r = httpx.post(url, json=_chat_body(), headers={**HEADERS, "Last-Event-ID": "abc:3f:1"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "stream_not_found"
    r = httpx.post(url, json=_chat_body(), headers={**HEADERS, "Last-Event-ID": "nonsense"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "Last-Event-ID"


def test_a_stream_that_went_out_whole_can_be_read_again_within_the_window(
    live: Live,
) -> None:
    # sent is not received: the last events may have been lost with the connection
    whole = _post(live.base_url, "/v1/chat/completions", _chat_body(10), Sse())
    rest = _post(
        live.base_url, "/v1/chat/completions", _chat_body(10), Sse(), last_event_id=whole.ids[2]
    )
    assert rest.data == whole.data[3:]
    assert rest.ids == whole.ids[3:]
    after_all = _post(
        live.base_url, "/v1/chat/completions", _chat_body(10), Sse(), last_event_id=whole.ids[-1]
    )
    assert after_all.data == []


@pytest.fixture
def short_window() -> Iterator[Live]:
    yield from _live(window_s=0.2)


def test_a_stream_not_resumed_within_the_window_is_cancelled(short_window: Live) -> None:
    live = short_window
    live.engine.step_s = 0.02  # still generating when the window passes
    first = _post(live.base_url, "/v1/chat/completions", _chat_body(), Sse(), stop_after=3)
    [cancel] = live.engine.wait_for_cancels(1)
    assert cancel.reason == "client disconnected"
    headers = {**HEADERS, "Last-Event-ID": first.last_id}
    r = httpx.post(live.base_url + "/v1/chat/completions", json=_chat_body(), headers=headers)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "stream_not_found"


def test_a_finished_stream_is_forgotten_once_its_window_passed(short_window: Live) -> None:
    live = short_window
    whole = _post(live.base_url, "/v1/chat/completions", _chat_body(10), Sse())
    streams = live.app.state.gateway.service.streams
    wait_until(lambda: len(streams) == 0, 10, "the stream to be forgotten")
    headers = {**HEADERS, "Last-Event-ID": whole.ids[2] or ""}
    r = httpx.post(live.base_url + "/v1/chat/completions", json=_chat_body(10), headers=headers)
    assert r.status_code == 404, r.text
    assert not live.engine.cancels  # it had finished: nothing to cancel


def test_a_responses_stream_resumes_with_its_sequence_unbroken(live: Live) -> None:
    body = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 120, "stream": True}
    first = _post(live.base_url, "/v1/responses", body, Sse(), stop_after=15)
    rest = _post(live.base_url, "/v1/responses", body, Sse(), last_event_id=first.last_id)
    events = first.chunks() + rest.chunks()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == REPLY[:120]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["output_tokens"] == 120
    assert len(live.engine.requests) == 1
