"""Every failure answers the OpenAI error object with the status the SDK expects."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, served_model
from tests.unit.api.test_chat_completions import CHAT, sse_payloads


def assert_error(
    r: Any, status: int, error_type: str, code: str | None, param: str | None = None
) -> None:
    assert r.status_code == status, r.text
    assert r.headers["x-request-id"].startswith("req_")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (error_type, code)
    if param is not None:
        assert error["param"] == param
    assert error["message"]


def test_bad_json(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_request_error", None)


def test_missing_field(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": "tiny"})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "messages")


def test_wrong_type(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 7})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "temperature")


def test_unknown_model(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert_error(r, 404, "invalid_request_error", "model_not_found", "model")
    assert_error(client.get("/v1/models/nope"), 404, "invalid_request_error", "model_not_found")


def test_context_too_long(client: TestClient, engine: FakeEngineWorker) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 250})
    assert_error(r, 400, "invalid_request_error", "context_length_exceeded", "messages")
    assert "256" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1] * 300})
    assert_error(r, 400, "invalid_request_error", "context_length_exceeded", "prompt")
    assert engine.requests == []


@pytest.mark.parametrize("header", [{"Authorization": "Bearer wrong"}, {"Authorization": ""}])
def test_bad_key(client: TestClient, header: dict[str, str]) -> None:
    r = client.get("/v1/models", headers=header)
    assert_error(r, 401, "authentication_error", r.json()["error"]["code"])
    assert r.json()["error"]["code"] in {"invalid_api_key", "missing_api_key"}
    r = client.post("/v1/chat/completions", json=CHAT, headers=header)
    assert r.status_code == 401


def test_limits_and_unsupported(client: TestClient) -> None:
    assert_error(
        client.post("/v1/chat/completions", json={**CHAT, "n": 9}),
        400,
        "invalid_request_error",
        "invalid_value",
        "n",
    )
    r = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 21})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "top_logprobs")
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": [{"type": "function"}]})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "tools[0].function")
    r = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"999": 1}})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "logit_bias")
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 50})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "logprobs")
    r = client.post("/v1/chat/completions", json=CHAT, headers={"x-sluice-timeout-ms": "soon"})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "x-sluice-timeout-ms")


def test_body_too_large(client: TestClient) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_error(
        client.post("/v1/chat/completions", json=big),
        413,
        "invalid_request_error",
        "request_too_large",
    )


def test_unknown_route(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, "invalid_request_error", "not_found")


def test_engine_error_non_stream_and_stream(client: TestClient, engine: FakeEngineWorker) -> None:
    engine.mode = "error"
    r = client.post("/v1/chat/completions", json=CHAT)
    assert_error(r, 500, "server_error", "engine_error")
    assert "boom" not in r.json()["error"]["message"]  # the engine's words stay in the log
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
        payloads = sse_payloads(s.read().decode())
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["type"] == "server_error"
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-2]) == "He"


def test_engine_deadline(client: TestClient, engine: FakeEngineWorker) -> None:
    engine.mode = "deadline"
    r = client.post("/v1/chat/completions", json=CHAT)
    assert_error(r, 504, "timeout_error", "deadline_exceeded")
    assert r.headers["x-should-retry"] == "false"
    with client.stream(
        "POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True}
    ) as s:
        payloads = sse_payloads(s.read().decode())
    assert payloads[-2]["error"]["code"] == "deadline_exceeded"


def test_gateway_deadline_cancels(client: TestClient, engine: FakeEngineWorker) -> None:
    """The engine never answers: past the deadline (+grace) the gateway gives up and cancels."""
    engine.mode = "hang"
    r = client.post("/v1/chat/completions", json=CHAT, headers={"x-sluice-timeout-ms": "100"})
    assert_error(r, 504, "timeout_error", "deadline_exceeded")
    [req] = engine.wait_for_requests(1)
    [cancel] = engine.wait_for_cancels(1)
    assert (cancel.request_id, cancel.tenant_id, cancel.reason) == (
        req.request_id,
        "default",
        "deadline",
    )


def test_open_mode_accepts_any_key(memory_bus: MemoryEventBus, engine: FakeEngineWorker) -> None:
    app: FastAPI = create_app(gateway_settings(api_keys=[]), memory_bus, [served_model()])
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200
    assert API_KEY
