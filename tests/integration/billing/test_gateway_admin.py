"""Gateway tenancy edges on the embedded stores: budgets, static-key precedence, admin API."""

from __future__ import annotations

import httpx

from sluice.billing import admin
from sluice.storage.db import Database
from sluice.storage.quota_memory import MemoryQuotaStore
from tests.integration.billing.conftest import ADMIN, STATIC
from tests.integration.billing.gateway_stack import MODEL, Stack, start_stack
from tests.integration.billing.test_gateway_tenancy import auth, chat


def test_exhausted_budget_is_429_insufficient_quota_without_retry(
    stack: Stack, sqlite_db: Database
) -> None:
    # ~40 prompt tokens + 8 completion at $1/$2 per 1M: the estimate exceeds $0.00001
    poor = admin.create_tenant(sqlite_db, "poor", rpm=60, tpm=10_000, monthly_budget_usd="0.00001")
    r = httpx.post(f"{stack.urls[0]}/v1/chat/completions", json=chat(8),
                   headers=auth(poor["api_key"]))  # fmt: skip
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "insufficient_quota"
    assert r.json()["error"]["type"] == "insufficient_quota"
    assert r.headers["x-should-retry"] == "false"
    assert "retry-after" not in r.headers  # it resets next month: nothing to wait for
    assert r.headers["x-ratelimit-limit-requests"] == "60"
    assert r.headers["x-ratelimit-limit-tokens"] == "10000"


def test_static_key_works_only_while_the_tenant_store_is_empty(
    stack: Stack, sqlite_db: Database
) -> None:
    url = f"{stack.urls[0]}/v1/models"
    assert httpx.get(url, headers=auth(STATIC)).status_code == 200
    assert httpx.get(url, headers=auth("sk-wrong")).status_code == 401
    tenant = admin.create_tenant(sqlite_db, "first")
    stack.servers[0].server.config.app.state.authenticator._empty = None  # skip the 5 s cache
    assert httpx.get(url, headers=auth(STATIC)).status_code == 401
    assert httpx.get(url, headers=auth(tenant["api_key"])).status_code == 200
    revoked = httpx.post(f"{stack.urls[0]}/admin/v1/keys/{tenant['key_id']}/revoke",
                         headers=auth(ADMIN))  # fmt: skip
    assert revoked.status_code == 200
    stack.services[0].auth.invalidate()
    r = httpx.get(url, headers=auth(tenant["api_key"]))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_admin_api(stack: Stack) -> None:
    base = f"{stack.urls[0]}/admin/v1"
    assert httpx.get(f"{base}/tenants").status_code == 401
    assert httpx.get(f"{base}/tenants", headers=auth("nope")).status_code == 401
    h = auth(ADMIN)
    created = httpx.post(f"{base}/tenants", headers=h,
                         json={"name": "acme", "rpm": 10, "monthly_budget_usd": "5"})  # fmt: skip
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["api_key"].startswith("sk-sluice-") and body["monthly_budget_usd"] == "5"
    dup = httpx.post(f"{base}/tenants", headers=h, json={"name": "acme"})
    assert dup.status_code == 409
    tenants = httpx.get(f"{base}/tenants", headers=h).json()["data"]
    assert [t["name"] for t in tenants] == ["acme"]
    key = httpx.post(f"{base}/keys", headers=h, json={"tenant": "acme", "name": "ci"}).json()
    keys = httpx.get(f"{base}/keys", headers=h, params={"tenant": "acme"}).json()["data"]
    assert {k["key_id"] for k in keys} == {body["key_id"], key["key_id"]}
    assert all("api_key" not in k for k in keys)
    assert httpx.post(f"{base}/keys", headers=h, json={"tenant": "nope"}).status_code == 404
    price = {"model": "m", "input_usd": "0.15", "cached_input_usd": "0.075", "output_usd": "0.6"}
    assert httpx.put(f"{base}/prices", headers=h, json=price).status_code == 200
    prices = httpx.get(f"{base}/prices", headers=h).json()["data"]
    assert {p["model"] for p in prices} == {MODEL, "m"}
    r = httpx.post(f"{stack.urls[0]}/v1/chat/completions", json=chat(4),
                   headers=auth(key["api_key"]))  # fmt: skip
    assert r.status_code == 200
    stack.wait(lambda: _requests(base, h, "acme") == 1, what="the ledger row")
    bad = httpx.get(f"{base}/usage", headers=h, params={"since": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None


def _requests(base: str, headers: dict[str, str], tenant: str) -> int:
    r = httpx.get(f"{base}/usage", headers=headers, params={"tenant": tenant})
    assert r.status_code == 200, r.text
    count: int = r.json()["totals"]["requests"]
    return count


def test_admin_api_is_disabled_without_an_admin_key(sqlite_db: Database) -> None:
    store = MemoryQuotaStore()
    s = start_stack(sqlite_db, lambda: store)
    try:
        r = httpx.get(f"{s.urls[0]}/admin/v1/tenants", headers=auth("anything"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    finally:
        s.close()
