"""Responses WebSocket mode against a hostile client (issue 33): one connection holds
bounded state whatever it sends, and a key revoked while its socket is open stops it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketTestSession
from starlette.websockets import WebSocketDisconnect

from sluice.api.app import create_app
from sluice.billing import admin
from sluice.billing.admission import AdmissionService
from sluice.bus.memory import MemoryEventBus
from sluice.storage.db import Database, embedded_url
from sluice.storage.keys import KeyAuthenticator
from sluice.storage.prices import PriceBook, PriceCache
from sluice.storage.quota_memory import MemoryQuotaStore
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, served_model

pytestmark = pytest.mark.timeout(60)

CREATE = {"type": "response.create", "model": "tiny", "input": "Hi"}
TERMINAL = ("error", "response.completed", "response.failed")


def _until_done(ws: WebSocketTestSession) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        events.append(ws.receive_json())
        if events[-1]["type"] in TERMINAL:
            return events


def _client(memory_bus: MemoryEventBus, **overrides: object) -> TestClient:
    app = create_app(gateway_settings(**overrides), memory_bus, [served_model("tiny")])
    return TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"})


def test_events_past_the_pending_cap_get_an_error_event_and_are_dropped(
    memory_bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    engine.mode = "hang"  # every response stays running
    with _client(memory_bus, ws_max_pending=3) as client:
        with client.websocket_connect("/v1/responses") as ws:
            for i in range(5):
                ws.send_json({**CREATE, "stream_id": f"s{i}"})
            refused: list[dict[str, Any]] = []
            while len(refused) < 2:  # the running ones send their first events meanwhile
                event = ws.receive_json()
                if event["type"] == "error":
                    refused.append(event)
        engine.wait_for_cancels(3)  # the socket's close cancelled the three it ran
    assert [e["stream_id"] for e in refused] == ["s3", "s4"]
    for event in refused:
        assert event["type"] == "error" and event["status"] == 429
        assert event["error"]["code"] == "too_many_pending_events"
    assert len(engine.wait_for_requests(3)) == 3


def test_finished_streams_are_forgotten_so_a_connection_runs_any_number_of_them(
    memory_bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    with (
        _client(memory_bus, ws_max_pending=2) as client,
        client.websocket_connect("/v1/responses") as ws,
    ):
        for i in range(6):  # distinct ids, one after the other
            ws.send_json({**CREATE, "stream_id": f"s{i}"})
            assert _until_done(ws)[-1]["type"] == "response.completed"
        # bogus events with distinct ids are answered and forgotten as well
        for i in range(200):
            ws.send_json({"type": "nonsense", "stream_id": f"b{i}"})
            assert ws.receive_json()["error"]["code"] == "unsupported_event"
        ws.send_json({**CREATE, "stream_id": "last"})
        assert _until_done(ws)[-1]["type"] == "response.completed"


@pytest.fixture
def tenancy(tmp_path: Path) -> Iterator[tuple[Database, AdmissionService]]:
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    # no auth cache: a revocation shows at the next lookup (the gateway's is 5 s)
    keys = KeyAuthenticator(db, cache_ttl_s=0.0)
    yield db, AdmissionService(keys, MemoryQuotaStore(), PriceCache(PriceBook(db)))
    db.close()


def test_a_revoked_key_stops_its_open_socket(
    memory_bus: MemoryEventBus,
    engine: FakeEngineWorker,
    tenancy: tuple[Database, AdmissionService],
) -> None:
    db, admission = tenancy
    tenant = admin.create_tenant(db, "acme")
    app = create_app(gateway_settings(), memory_bus, [served_model("tiny")], admission=admission)
    headers = {"Authorization": f"Bearer {tenant['api_key']}"}
    with (
        TestClient(app, headers=headers) as client,
        client.websocket_connect("/v1/responses") as ws,
    ):
        ws.send_json(CREATE)
        assert _until_done(ws)[-1]["type"] == "response.completed"
        admin.revoke_key(db, str(tenant["key_id"]))
        ws.send_json(CREATE)
        [error] = _until_done(ws)
        assert error["status"] == 401
        assert error["error"]["type"] == "authentication_error"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert closed.value.code == 1008
    assert len(engine.requests) == 1  # the create after the revocation never ran
