"""The gateway on a real loopback server, driven by the official `openai` SDK.

Memory bus and the fake engine worker behind it; the client side is the real SDK
(httpx2 for HTTP, websockets for `client.responses.connect()`), so the wire details
(SSE framing, error bodies, Responses events, WebSocket URL) are checked end to end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from sluice.api.app import create_app
from sluice.bus.codec import encode
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import TokenDelta, TokenDeltaBatch, Usage
from sluice.bus.topics import Lane, TopicLayout, reply_topic, request_topic
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[ServerThread, FakeEngineWorker]]:
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=2, pools=("tiny",)).specs())
    worker = FakeEngineWorker(bus).start()
    app = create_app(gateway_settings(), bus, [served_model("tiny")])
    with ServerThread(app) as server:
        yield server, worker
    worker.stop()
    bus.close()


@pytest.fixture
def server(live: tuple[ServerThread, FakeEngineWorker]) -> ServerThread:
    return live[0]


@pytest.fixture
def engine(live: tuple[ServerThread, FakeEngineWorker]) -> Iterator[FakeEngineWorker]:
    worker = live[1]
    worker.mode, worker.requests[:], worker.cancels[:] = "echo", [], []
    yield worker
    worker.mode = "echo"


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def test_sdk_chat(client: openai.OpenAI, engine: FakeEngineWorker) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        service_tier="priority",
        metadata={"k": "v"},
        store=False,
    )
    assert raw.headers["x-request-id"].startswith("req_")
    completion = raw.parse()
    assert completion.choices[0].message.content == "Hello world"
    assert completion.service_tier == "priority"
    assert engine.requests[0][0] == request_topic(Lane.INTERACTIVE, "tiny")


def test_sdk_chat_stream_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 11
    assert all(c.usage is None for c in chunks[:-1])


def test_sdk_completions_and_errors(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4)
    assert completion.choices[0].text == "Hell"
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="nope", prompt="x")
    assert not_found.value.code == "model_not_found"
    assert not_found.value.request_id and not_found.value.request_id.startswith("req_")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[1] * 250, max_tokens=10)
    assert too_long.value.code == "context_length_exceeded"


def test_sdk_bad_key(server: ServerThread) -> None:
    c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="bad", max_retries=0)
    with c, pytest.raises(openai.AuthenticationError) as exc:
        c.models.list()
    assert exc.value.code == "invalid_api_key"


def test_sdk_stream_error_raises(client: openai.OpenAI, engine: FakeEngineWorker) -> None:
    engine.mode = "error"
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="the engine failed") as exc:
        list(stream)
    assert "boom" not in str(exc.value)  # the engine's own words stay in the gateway's log


def test_sdk_responses(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Hi", instructions="Be brief")
    assert response.output_text == "Hello world"
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens == 11
    short = client.responses.create(model="tiny", input="Hi", max_output_tokens=5)
    assert (short.output_text, short.status) == ("Hello", "incomplete")
    assert short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"


def test_sdk_responses_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="tiny", input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello world"
    assert events[-1].response.output_text == "Hello world"


def test_sdk_responses_websocket(client: openai.OpenAI) -> None:
    with client.responses.connect() as connection:
        for prompt in ("first", "second"):
            connection.response.create(model="tiny", input=prompt, max_output_tokens=5)
            text, kinds = "", []
            for event in connection:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type in ("response.completed", "response.incomplete", "error"):
                    break
            assert kinds[0] == "response.created"
            assert kinds[-1] == "response.incomplete"
            assert text == "Hello"
        connection.response.create(model="nope", input="x")
        error = connection.recv()
        assert error.type == "error"
        assert error.error.code == "model_not_found"  # type: ignore[union-attr]


def test_websocket_close_cancels(server: ServerThread, engine: FakeEngineWorker) -> None:
    engine.mode = "hang"
    c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    with c, c.responses.connect() as connection:
        connection.response.create(model="tiny", input="Hi")
        assert connection.recv().type == "response.created"
        [req] = engine.wait_for_requests(1)
    # sent again with the gateway's heartbeats until the engine's terminal delta comes
    cancels = engine.wait_for_cancels(1)
    assert {c.request_id for c in cancels} == {req.request_id}


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels(
    server: ServerThread, engine: FakeEngineWorker, stream: bool
) -> None:
    """A client that goes away (stream or not) makes the gateway publish a Cancel: at
    once, or for a stream once its resume window passed (`api/resume.py`)."""
    engine.mode = "hang"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": stream}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=10) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the role chunk: the request is live
                [req] = engine.wait_for_requests(1)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body, timeout=0.5)
            [req] = engine.wait_for_requests(1)
    cancels = engine.wait_for_cancels(1)  # perhaps sent again before the terminal came
    assert {(c.request_id, c.reason) for c in cancels} == {(req.request_id, "client disconnected")}


def test_failover_stream_seen_once_by_the_sdk(
    client: openai.OpenAI, engine: FakeEngineWorker
) -> None:
    """The engine side fails over mid-stream: the SDK's stream still reads "Hello world"."""
    engine.mode = "hang"
    bus = engine.bus

    def script() -> None:
        [req] = engine.wait_for_requests(1)
        target = reply_topic(req.reply_to)

        def send(attempt: int, seq_no: int, offset: int, text: str, **kw: object) -> None:
            d = TokenDelta(
                request_id=req.request_id,
                attempt=attempt,
                seq_no=seq_no,
                token_offset=offset,
                text_offset=offset,
                token_ids=list(text.encode()),
                text=text,
                **kw,  # type: ignore[arg-type]
            )
            bus.publish(target, encode(TokenDeltaBatch(reply_to=req.reply_to, deltas=[d])))

        send(0, 0, 0, "Hel")
        send(1, 0, 1, "ello")  # resumed attempt overlaps "el"
        send(0, 1, 3, "XX")  # late delta of the dead attempt
        usage = Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=11)
        send(1, 1, 5, " world", finish_reason="stop", usage=usage)

    thread = threading.Thread(target=script)
    thread.start()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream]
    thread.join()
    assert "".join(pieces) == "Hello world"
    assert "XX" not in pieces
