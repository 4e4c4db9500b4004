"""Per-tenant model access and LoRA adapters loaded at run time, end to end on PostgreSQL.

Two gateway apps (each with its own admission service and auth cache) share the tenant
store and a memory bus with the fake engine worker behind them; clients are the real
`openai` SDK and httpx. A tenant's private adapter is listed and served to it alone; to
every other tenant it answers exactly as a name that does not exist. A load through one
gateway is served by the other within its catalog's refresh.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluice.api.app import create_app, model_catalog, request_limits
from sluice.billing import admin
from sluice.billing.admission import AdmissionService
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.consumers.batches.runner import BatchConfig, BatchRunner
from sluice.settings import GatewaySettings
from sluice.storage.adapters import AdapterStore
from sluice.storage.batches import BatchStore
from sluice.storage.db import Database
from sluice.storage.keys import KeyAuthenticator
from sluice.storage.prices import PriceBook, PriceCache
from sluice.storage.quota_memory import MemoryQuotaStore
from tests.integration.storage.stores import empty
from tests.unit.api.conftest import gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model
from tests.waiting import wait_until

ADMIN = "sk-admin-access"
MODEL = "tiny"
CHAT = "/v1/chat/completions"


def adapter_dir(root: Path, name: str, **config: Any) -> Path:
    """A PEFT LoRA directory as the gateway checks it (the weights are the worker's)."""
    path = root / name
    path.mkdir(parents=True)
    body = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**body, **config}))
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 8)
    return path


@dataclass
class Fleet:
    db: Database
    bus: MemoryEventBus
    engine: FakeEngineWorker
    settings: GatewaySettings
    servers: list[ServerThread]
    adapters: Path

    def url(self, i: int = 0) -> str:
        return self.servers[i].base_url

    def client(self, api_key: str, i: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url(i)}/v1", api_key=api_key, max_retries=0)

    def post(self, path: str, body: dict[str, Any], i: int = 0) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.post(f"{self.url(i)}{path}", json=body, headers=headers, timeout=10)

    def load(self, name: str, i: int = 0, **extra: Any) -> httpx.Response:
        path = extra.pop("lora_path", None) or str(adapter_dir(self.adapters, name))
        body = {"lora_name": name, "lora_path": path, **extra}
        return self.post("/v1/load_lora_adapter", body, i)


@pytest.fixture
def fleet(pg_database: Database, tmp_path: Path) -> Iterator[Fleet]:
    empty(pg_database)
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=1, pools=(MODEL,)).specs())
    engine = FakeEngineWorker(bus).start()
    started = adapter_dir(tmp_path, "started")
    settings = gateway_settings(
        api_keys=[],
        admin_key=ADMIN,
        model_aliases={"tiny-alias": MODEL},
        lora_modules=[f"started={started}"],
        adapter_refresh_s=0.2,
    )
    servers = []
    for _ in range(2):
        auth = KeyAuthenticator(pg_database)
        admission = AdmissionService(auth, MemoryQuotaStore(), PriceCache(PriceBook(pg_database)))
        app = create_app(settings, bus, [served_model(MODEL)], admission=admission)
        servers.append(ServerThread(app).__enter__())
    yield Fleet(pg_database, bus, engine, settings, servers, tmp_path / "adapters")
    for server in servers:
        server.__exit__(None, None, None)
    engine.stop()
    bus.close()


def ids(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list()}


def not_found(call: Callable[[], object]) -> str:
    """The 404 of `call`: its error's message, once its shape is model_not_found's."""
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict)
    assert (body["type"], body["code"], body["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    return str(body["message"])


def uses(client: openai.OpenAI, model: str) -> list[Callable[[], object]]:
    """Every way a tenant may ask for `model`: chat, completions, responses, retrieve."""
    messages: Any = [{"role": "user", "content": "Hi"}]
    return [
        lambda: client.chat.completions.create(model=model, messages=messages, max_tokens=4),
        lambda: client.completions.create(model=model, prompt="Hi", max_tokens=4),
        lambda: client.responses.create(model=model, input="Hi", max_output_tokens=4),
        lambda: client.models.retrieve(model),
    ]


def test_tenant_b_cannot_see_or_use_tenant_a_private_adapter(fleet: Fleet) -> None:
    a = admin.create_tenant(fleet.db, "a")
    b = admin.create_tenant(fleet.db, "b")
    r = fleet.load("a-lora", tenant_id="a")
    assert r.status_code == 200, r.text
    with fleet.client(a["api_key"]) as ca, fleet.client(b["api_key"]) as cb:
        assert ids(ca) == {MODEL, "tiny-alias", "started", "a-lora"}
        assert ids(cb) == {MODEL, "tiny-alias", "started"}
        card = ca.models.retrieve("a-lora")
        assert card.owned_by == a["tenant_id"]
        extra = card.model_extra or {}
        assert extra["parent"] == MODEL and extra["root"].endswith("/a-lora")
        reply = ca.chat.completions.create(
            model="a-lora", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.model == "a-lora"
        sent = fleet.engine.requests[-1][1]
        assert sent.model == MODEL and sent.adapter is not None
        assert sent.adapter.name == "a-lora" and sent.adapter.path == extra["root"]
        before = len(fleet.engine.requests)
        for hidden, unknown in zip(uses(cb, "a-lora"), uses(cb, "no-such"), strict=True):
            message = not_found(hidden)
            assert message == not_found(unknown).replace("no-such", "a-lora")
        assert len(fleet.engine.requests) == before  # nothing of B's reached a worker
        # the other gateway, after its refresh, answers the same
        with fleet.client(b["api_key"], 1) as cb1, fleet.client(a["api_key"], 1) as ca1:
            wait_until(lambda: "a-lora" in ids(ca1), 5, "gateway 1 to serve a-lora")
            for call in uses(cb1, "a-lora"):
                not_found(call)


def test_a_tenant_allowed_one_model_sees_and_uses_only_it(fleet: Fleet) -> None:
    assert fleet.load("pub").status_code == 200
    h = {"Authorization": f"Bearer {ADMIN}"}
    created = httpx.post(
        f"{fleet.url()}/admin/v1/tenants",
        json={"name": "c", "allowed_models": ["tiny-alias"]},
        headers=h,
    )
    assert created.status_code == 201, created.text
    key = created.json()["api_key"]
    assert created.json()["allowed_models"] == ["tiny-alias"]
    with fleet.client(key) as c:
        assert ids(c) == {"tiny-alias"}
        reply = c.completions.create(model="tiny-alias", prompt="Hi", max_tokens=4)
        assert reply.choices[0].text
        for name in (MODEL, "started", "pub"):
            for call in uses(c, name):
                not_found(call)
        opened = httpx.put(
            f"{fleet.url()}/admin/v1/tenants/c/models", json={"allowed_models": None}, headers=h
        )
        assert opened.status_code == 200 and opened.json()["allowed_models"] is None
        assert ids(c) == {MODEL, "tiny-alias", "started", "pub"}  # this gateway: at once
        bad = httpx.put(
            f"{fleet.url()}/admin/v1/tenants/c/models", json={"allowed_models": [""]}, headers=h
        )
        assert bad.status_code == 400
        missing = httpx.put(
            f"{fleet.url()}/admin/v1/tenants/nobody/models", json={"allowed_models": []}, headers=h
        )
        assert missing.status_code == 404


def test_load_and_unload_reach_every_gateway_within_the_refresh(fleet: Fleet) -> None:
    t = admin.create_tenant(fleet.db, "t")
    r = fleet.load("pub", 0)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'pub' added successfully."
    with fleet.client(t["api_key"], 0) as c0, fleet.client(t["api_key"], 1) as c1:
        assert "pub" in ids(c0)  # the loading gateway serves it from its answer on
        wait_until(lambda: "pub" in ids(c1), 5, "the other gateway to serve pub")
        listed = httpx.get(
            f"{fleet.url(1)}/admin/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()["data"]
        assert [(x["name"], x["base_model"], x["tenant_id"]) for x in listed] == [
            ("pub", MODEL, None)
        ]
        gone = fleet.post("/v1/unload_lora_adapter", {"lora_name": "pub"}, 1)
        assert gone.status_code == 200
        assert gone.text == "Success: LoRA adapter 'pub' removed successfully."
        not_found(lambda: c1.models.retrieve("pub"))
        wait_until(lambda: "pub" not in ids(c0), 5, "gateway 0 to drop pub")
        # loaded again, the name is free once more
        assert fleet.post("/v1/load_lora_adapter", {"lora_name": "pub",
                          "lora_path": str(fleet.adapters / "pub")}).status_code == 200  # fmt: skip


def test_bad_loads_are_openai_errors(fleet: Fleet) -> None:
    root = fleet.adapters
    root.mkdir()
    (root / "no-config").mkdir()
    (root / "not-json").mkdir()
    (root / "not-json" / "adapter_config.json").write_text("{nope")
    no_weights = adapter_dir(root, "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    prefix = adapter_dir(root, "prefix", peft_type="PREFIX_TUNING")
    good = str(adapter_dir(root, "good"))
    for path, words in [
        (root / "missing", "adapter_config.json"),
        (root / "no-config", "adapter_config.json"),
        (root / "not-json", "cannot read"),
        (no_weights, ".safetensors"),
        (prefix, "not LORA"),
    ]:
        r = fleet.load("x", lora_path=str(path))
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["error"]["message"]
    for name, extra in [
        (MODEL, {}),  # a base model's name
        ("tiny-alias", {}),  # an alias's
        ("started", {}),  # an adapter of --lora
        ("y", {"base_model": "elsewhere"}),  # a base not served here
        ("y", {"surprise": 1}),  # a field vLLM does not have
    ]:
        r = fleet.load(name, lora_path=good, **extra)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert fleet.load("z", lora_path=good, tenant_id="nobody").status_code == 404
    assert fleet.load("z", lora_path=good).status_code == 200
    twice = fleet.load("z", lora_path=good)
    assert twice.status_code == 400 and "already been loaded" in twice.json()["error"]["message"]
    unknown = fleet.post("/v1/unload_lora_adapter", {"lora_name": "never"})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    started = fleet.post("/v1/unload_lora_adapter", {"lora_name": "started"})
    assert started.status_code == 400 and "--lora" in started.json()["error"]["message"]
    anonymous = httpx.post(
        f"{fleet.url()}/v1/load_lora_adapter", json={"lora_name": "q", "lora_path": good}
    )
    assert anonymous.status_code == 401


def test_batch_lines_are_checked_against_the_owner_access(fleet: Fleet) -> None:
    a = admin.create_tenant(fleet.db, "a")
    b = admin.create_tenant(fleet.db, "b")
    path = adapter_dir(fleet.adapters, "a-lora")
    AdapterStore(fleet.db).register("a-lora", MODEL, str(path), owner="a")
    store = BatchStore(fleet.db)
    models = [served_model(MODEL)]
    catalog = model_catalog(fleet.settings, models, fleet.db)
    config = BatchConfig(grace_s=0.5)
    runner = BatchRunner(
        store, fleet.bus, models, request_limits(fleet.settings), config, catalog=catalog
    )

    def batch(tenant_id: str) -> str:
        body = {"model": "a-lora", "messages": [{"role": "user", "content": "hi"}]}
        line = {"custom_id": "1", "method": "POST", "url": CHAT, "body": body | {"max_tokens": 3}}
        file = store.create_file(tenant_id, "batch", "in.jsonl", json.dumps(line).encode())
        return store.create_batch(
            tenant_id=tenant_id, key_id=None, input_file_id=file.id, endpoint=CHAT,
            completion_window="24h", window_s=3600, metadata=None,
        ).id  # fmt: skip

    refused = batch(b["tenant_id"])
    runner.validate(refused)
    info = store.get_batch(refused)
    assert info is not None and info.status == "failed"
    error = (info.errors or [])[0]
    assert error["code"] == "model_not_found" and "a-lora" not in error["message"].split("(")[1]
    allowed = batch(a["tenant_id"])
    runner.validate(allowed)
    info = store.get_batch(allowed)
    assert info is not None and info.status == "in_progress"
    wait_until(
        lambda: any(
            r.adapter is not None and r.adapter.name == "a-lora" for _, r in fleet.engine.requests
        ),
        5,
        "A's batch line to reach the worker with its adapter",
    )
