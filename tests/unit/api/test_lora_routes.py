"""The LoRA routes on a gateway without a tenant store: `--lora` adapters are served and
listed; loading at run time needs the store and the admin key."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, served_model


def test_static_adapters_without_a_store(
    tmp_path: Path, memory_bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    settings = gateway_settings(admin_key="sk-admin", lora_modules=[f"sql={tmp_path}"])
    app = create_app(settings, memory_bus, [served_model("tiny")])
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == str(tmp_path)
        assert cards["tiny"]["root"] == "tiny" and cards["tiny"]["parent"] is None
        r = client.post(
            "/v1/chat/completions",
            json={"model": "sql", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200 and r.json()["model"] == "sql"
        sent = engine.requests[-1][1]
        assert sent.model == "tiny" and sent.adapter is not None
        assert sent.adapter.path == str(tmp_path)
        body = {"lora_name": "x", "lora_path": str(tmp_path)}
        r = client.post("/v1/load_lora_adapter", json=body)  # a tenant key is not the admin's
        assert r.status_code == 401
        admin = {"Authorization": "Bearer sk-admin"}
        r = client.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "adapters_unavailable"


def test_without_an_admin_key_the_routes_are_disabled(
    memory_bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    app = create_app(gateway_settings(), memory_bus, [served_model("tiny")])
    with TestClient(app) as client:
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
