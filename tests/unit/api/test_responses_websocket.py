"""Responses WebSocket mode: a bad event is answered and the socket serves the next one.

A bad `response.create` (a `text.format` that is not an object, a lone surrogate) used to
end its lane silently, an unexpected exception killed the lane with nothing logged, a
binary frame dropped the socket with a KeyError, and every refused handshake logged an
ERROR. Also the `Origin` allow-list, and `text.format` over plain HTTP.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import WebSocketTestSession
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from sluice.api.app import create_app
from sluice.api.streaming import WsSession, ws_error
from sluice.bus.memory import MemoryEventBus
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model

# a lane that dies silently leaves `receive_json` waiting forever: fail sooner than that
pytestmark = pytest.mark.timeout(60)

CREATE = {"type": "response.create", "model": "tiny", "input": "Hi"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _until_done(ws: WebSocketTestSession) -> list[dict[str, Any]]:
    """Events up to and including the response's terminal one (or an error)."""
    events: list[dict[str, Any]] = []
    while True:
        event = ws.receive_json()
        events.append(event)
        if event["type"] in ("error", "response.completed", "response.failed"):
            return events


def _refusal(client: TestClient) -> WebSocketDisconnect:
    """How the gateway refused this client's handshake (it must refuse it)."""
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/v1/responses"):
        pass
    return refused.value


def _assert_completes(ws: WebSocketTestSession, stream_id: str | None = None) -> None:
    events = _until_done(ws)
    assert events[-1]["type"] == "response.completed", events[-1]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello world"
    assert all(e.get("stream_id") == stream_id for e in events)


@pytest.mark.parametrize("fmt", ["x", ["json"], 3, {"type": 5}])
def test_a_text_format_that_is_not_an_object_is_an_error_event_and_the_lane_lives(
    client: TestClient, fmt: Any
) -> None:
    with client.websocket_connect("/v1/responses") as ws:
        ws.send_json({**CREATE, "text": {"format": fmt}})
        ws.send_json(CREATE)
        [error] = _until_done(ws)
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == "invalid_type"
        assert error["error"]["param"] in ("text.format", "text.format.type")
        _assert_completes(ws)


def test_a_lone_surrogate_is_an_error_event_and_the_lane_lives(client: TestClient) -> None:
    with client.websocket_connect("/v1/responses") as ws:
        ws.send_text(json.dumps({**CREATE, "input": "\ud800", "stream_id": "s1"}))
        ws.send_text(json.dumps({**CREATE, "stream_id": "s1"}))
        [error] = _until_done(ws)
        assert error["error"]["param"] == "input"
        assert error["error"]["code"] == "invalid_value"
        assert error["stream_id"] == "s1"  # answered on its lane, in order
        _assert_completes(ws, "s1")
        # a bad stream_id cannot be echoed back: answered untagged, then the socket goes on
        ws.send_text(json.dumps({**CREATE, "stream_id": "\udc00"}))
        [error] = _until_done(ws)
        assert error["error"]["param"] == "stream_id"
        assert "stream_id" not in error
        ws.send_json(CREATE)
        _assert_completes(ws)


def test_malformed_messages_are_error_events(client: TestClient) -> None:
    with client.websocket_connect("/v1/responses") as ws:
        for raw in ["{", "[1]", json.dumps({"type": "response.cancel"})]:
            ws.send_text(raw)
            assert ws.receive_json()["type"] == "error"
        ws.send_json(CREATE)
        _assert_completes(ws)


def test_a_binary_frame_closes_with_unsupported_data(client: TestClient) -> None:
    with client.websocket_connect("/v1/responses") as ws:
        ws.send_bytes(json.dumps(CREATE).encode())
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
    assert closed.value.code == 1003
    assert "binary" in closed.value.reason


# -- an unexpected failure inside one event ------------------------------------------------
async def _failing_source(event: dict[str, Any], call_id: str) -> AsyncIterator[dict[str, Any]]:
    """Raises a bug for `{"boom": true}`, else answers one `done` event."""
    if event.get("boom"):
        raise ZeroDivisionError("a bug in handling")
    yield {"type": "done", "call_id": call_id}


async def _session(websocket: WebSocket) -> None:
    await websocket.accept()
    await WsSession(websocket, _failing_source).run()


def test_an_exception_in_one_event_is_logged_and_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Starlette(routes=[WebSocketRoute("/ws", _session)])
    caplog.set_level(logging.INFO, logger="sluice.api.streaming")
    with TestClient(app) as client, client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "response.create", "boom": True, "stream_id": "a"})
        ws.send_json({"type": "response.create", "stream_id": "a"})
        error = ws.receive_json()
        assert error["type"] == "error"
        assert error["error"]["type"] == "server_error"
        assert error["stream_id"] == "a"
        assert ws.receive_json()["type"] == "done"  # the lane serves the next event
    [failure] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    request_id = failure.getMessage().split("request_id=")[1].split()[0]
    assert request_id.startswith("req_")
    assert request_id in error["error"]["message"]
    assert failure.exc_info is not None and failure.exc_info[0] is ZeroDivisionError


def test_ws_error_keeps_the_openai_shape() -> None:
    assert ws_error(400, "bad", "invalid_value", "input") == {
        "type": "error",
        "status": 400,
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_value",
            "message": "bad",
            "param": "input",
        },
    }


# -- refused handshakes ----------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}])
def test_an_unauthenticated_handshake_is_refused_with_policy_violation(
    app: FastAPI, headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with TestClient(app, headers=headers) as client:
        refused = _refusal(client)
    assert refused.code == 1008
    assert "API key" in refused.reason
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def origin_app(memory_bus: MemoryEventBus, engine: FakeEngineWorker) -> Iterator[FastAPI]:
    # as SLUICE_WS_ALLOWED_ORIGINS sets it
    settings = gateway_settings(ws_allowed_origins="https://chat.example.com, https://b.example")
    yield create_app(settings, memory_bus, [served_model("tiny", max_model_len=256)])


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://chat.example.com"])
def test_an_origin_outside_the_allow_list_is_refused(origin_app: FastAPI, origin: str) -> None:
    with TestClient(origin_app, headers={**AUTH, "Origin": origin}) as client:
        refused = _refusal(client)
    assert refused.code == 1008
    assert "origin" in refused.reason


@pytest.mark.parametrize("origin", ["https://chat.example.com", "https://Chat.example.com/", None])
def test_a_listed_origin_or_none_is_served(origin_app: FastAPI, origin: str | None) -> None:
    headers = AUTH if origin is None else {**AUTH, "Origin": origin}
    client = TestClient(origin_app, headers=headers)
    with client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json(CREATE)
        _assert_completes(ws)


def test_no_allow_list_serves_any_origin(app: FastAPI) -> None:
    client = TestClient(app, headers={**AUTH, "Origin": "https://anywhere.example"})
    with client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json(CREATE)
        _assert_completes(ws)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_refused_handshakes_on_uvicorn_are_403_without_an_error_line(origin_app: FastAPI) -> None:
    """uvicorn's default protocol logged every refused handshake as an ERROR."""
    collected = _Collect()
    with ServerThread(origin_app) as server:
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addHandler(collected)
        try:
            url = f"ws://127.0.0.1:{server.port}/v1/responses"
            for headers in [{}, {**AUTH, "Origin": "https://evil.example"}]:
                with (
                    pytest.raises(InvalidStatus) as refused,
                    connect(url, additional_headers=headers, open_timeout=10),
                ):
                    pass
                assert refused.value.response.status_code == 403
            with connect(url, additional_headers=AUTH, open_timeout=10) as ws:
                ws.send(json.dumps(CREATE))
                while json.loads(ws.recv(timeout=10))["type"] != "response.completed":
                    pass
        finally:
            uvicorn_log.removeHandler(collected)
    assert [r.getMessage() for r in collected.records] == []


# -- text.format over HTTP -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["x", ["json"], {"type": 5}])
def test_http_text_format_that_is_not_an_object_is_a_400(client: TestClient, fmt: Any) -> None:
    r = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "text": {"format": fmt}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("text.format", "text.format.type")


def test_http_text_format_text_is_served(client: TestClient) -> None:
    body = {"model": "tiny", "input": "Hi", "text": {"format": {"type": "text"}}}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
