"""Expensive invalid requests are bounded (issue 33): a body's message and content-part
counts are capped before validation and the chat template run, and every request of a
tenant counts against its requests per minute before that work, whatever its answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sluice.api.app import create_app
from sluice.api.deps import RequestRateGate
from sluice.api.errors import RateLimited
from sluice.billing import admin
from sluice.billing.admission import AdmissionService
from sluice.bus.memory import MemoryEventBus
from sluice.storage.db import Database, embedded_url
from sluice.storage.keys import KeyAuthenticator, Principal
from sluice.storage.prices import PriceBook, PriceCache
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.tenants import PlanLimits
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, served_model

USER = {"role": "user", "content": "Hi"}


def _chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2, "messages": messages}


@pytest.fixture
def client(memory_bus: MemoryEventBus, engine: FakeEngineWorker) -> Iterator[TestClient]:
    settings = gateway_settings(max_messages=4, max_content_parts=2)
    app = create_app(settings, memory_bus, [served_model("tiny")])
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_more_messages_than_the_limit_is_a_400_naming_messages(client: TestClient) -> None:
    assert client.post("/v1/chat/completions", json=_chat([USER] * 4)).status_code == 200
    response = client.post("/v1/chat/completions", json=_chat([USER] * 5))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert error["code"] == "array_above_max_length"
    assert "maximum length 4" in error["message"]


def test_more_content_parts_than_the_limit_is_a_400_naming_the_message(
    client: TestClient,
) -> None:
    parts = [{"type": "text", "text": "a"}] * 3
    messages = [USER, {"role": "user", "content": parts}]
    response = client.post("/v1/chat/completions", json=_chat(messages))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].content"


def test_responses_input_items_are_bounded_too(client: TestClient) -> None:
    body = {"model": "tiny", "max_output_tokens": 2, "input": [USER] * 5}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input"
    with client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", **body})
        event = ws.receive_json()
    assert event["type"] == "error" and event["error"]["param"] == "input"


def test_invalid_requests_count_against_the_tenants_rpm(
    tmp_path: Path, memory_bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    admission = AdmissionService(
        KeyAuthenticator(db), MemoryQuotaStore(), PriceCache(PriceBook(db))
    )
    tenant = admin.create_tenant(db, "acme", rpm=5)
    settings = gateway_settings(max_messages=4)
    app = create_app(settings, memory_bus, [served_model("tiny")], admission=admission)
    headers = {"Authorization": f"Bearer {tenant['api_key']}"}
    with TestClient(app, headers=headers) as http:
        answers = [
            http.post("/v1/chat/completions", json=_chat([USER] * 5)).status_code for _ in range(7)
        ]
        valid = http.post("/v1/chat/completions", json=_chat([USER]))
    db.close()
    # the plan's burst of 5 was spent on refused requests: the rest wait for the rpm
    assert answers == [400] * 5 + [429] * 2
    assert valid.status_code == 429
    assert valid.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(valid.headers["retry-after"]) >= 1
    assert engine.requests == []


def test_the_rate_gate_allows_the_plans_burst_then_one_request_per_interval() -> None:
    now = [1000.0]
    gate = RequestRateGate(clock=lambda: now[0])
    acme = Principal("acme", "key_a", PlanLimits(rpm=6))
    for _ in range(6):
        gate.check(acme)
    with pytest.raises(RateLimited) as refused:
        gate.check(acme)
    assert refused.value.headers["retry-after"] == "10"
    now[0] += 10.0  # 60 s / 6
    gate.check(acme)
    with pytest.raises(RateLimited):
        gate.check(acme)
    gate.check(Principal("other", "key_b", PlanLimits(rpm=1)))  # its own count
    gate.check(Principal("free", "key_c", None))  # no plan: never counted
