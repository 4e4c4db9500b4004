"""What admission took comes back on any failure after it; admin input the database can't
hold is a 400, on SQLite and PostgreSQL alike."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import pytest

from benchmarks.faults_infra import TcpProxy
from sluice.api import service as api_service
from sluice.billing import admin
from sluice.bus.memory import MemoryEventBus
from sluice.storage.db import Database
from sluice.storage.errors import InvalidInput, NotFound, StoreUnavailable
from sluice.storage.keys import KeyAuthenticator
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.tracing import spans as tracing_spans
from tests.integration.billing.conftest import ADMIN
from tests.integration.billing.gateway_stack import Stack, start_stack
from tests.integration.billing.test_gateway_tenancy import auth, chat
from tests.integration.storage.stores import empty


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected failure")


def _failed_future(*args: Any, **kwargs: Any) -> Future[None]:
    future: Future[None] = Future()
    future.set_exception(RuntimeError("injected failure"))
    return future


# each step between admission and a tracked, published request
INJECTIONS: dict[str, Callable[[pytest.MonkeyPatch, MemoryEventBus], None]] = {
    "trace headers": lambda mp, bus: mp.setattr(tracing_spans, "inject_headers", _boom),
    "encode": lambda mp, bus: mp.setattr(api_service, "encode", _boom),
    "publish raises": lambda mp, bus: mp.setattr(bus, "publish", _boom),
    "publish fails later": lambda mp, bus: mp.setattr(bus, "publish", _failed_future),
}


@pytest.mark.parametrize("step", list(INJECTIONS))
def test_a_failure_after_admission_releases_the_concurrency_slot(
    stack: Stack, sqlite_db: Database, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    tenant = admin.create_tenant(sqlite_db, "solo", rpm=1000, tpm=1_000_000, max_concurrency=1)
    url, headers = f"{stack.urls[0]}/v1/chat/completions", auth(tenant["api_key"])
    with monkeypatch.context() as mp:
        INJECTIONS[step](mp, stack.bus)
        for _ in range(2):  # twice: a leaked slot would make the second a 429
            r = httpx.post(url, json=chat(4), headers=headers, timeout=10)
            assert r.status_code in (500, 503), r.text
            assert r.json()["error"]["message"]
    r = httpx.post(url, json=chat(4), headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    ready = httpx.get(f"{stack.urls[0]}/readyz", timeout=5).json()
    assert ready["live_requests"] == 0


def _admin(stack: Stack, method: str, path: str, raw: str) -> httpx.Response:
    return httpx.request(
        method,
        f"{stack.urls[0]}/admin/v1{path}",
        content=raw.encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        timeout=10,
    )


@pytest.mark.parametrize(
    "method,path,raw",
    [
        ("POST", "/tenants", '{"name":"a","rpm":1180591620717411303424}'),  # 2**70
        ("POST", "/tenants", '{"name":"a","max_concurrency":2147483648}'),
        ("POST", "/tenants", '{"name":"a","monthly_budget_usd":"1e30"}'),
        ("POST", "/tenants", '{"name":"a","monthly_budget_usd":1e400}'),
        ("POST", "/tenants", '{"name":"a","monthly_budget_usd":"1e999999999"}'),
        ("POST", "/tenants", '{"name":"a","monthly_budget_usd":"sNaN"}'),
        ("POST", "/tenants", '{"name":"a\\ud800"}'),
        ("POST", "/tenants", '{"name":"a\\u0000b"}'),
        ("POST", "/keys", '{"tenant":"t","name":"k\\u0000"}'),
        ("PUT", "/prices", '{"model":"m","input_usd":"1e30","cached_input_usd":"0",'
                           '"output_usd":"0"}'),
        ("PUT", "/prices", '{"model":"m\\u0000","input_usd":"1","cached_input_usd":"0",'
                           '"output_usd":"0"}'),
    ],
)  # fmt: skip
def test_admin_input_the_database_cannot_hold_is_400(
    stack: Stack, sqlite_db: Database, method: str, path: str, raw: str
) -> None:
    admin.create_tenant(sqlite_db, "t")
    r = _admin(stack, method, path, raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_admin_lookups_of_impossible_names_are_404(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    for path in ("/usage?tenant=%00", "/keys?tenant=a%00"):
        r = httpx.get(f"{stack.urls[0]}/admin/v1{path}", headers=headers, timeout=10)
        assert r.status_code == 404, r.text


def test_bounds_hold_on_both_databases(db: Database) -> None:
    with pytest.raises(InvalidInput):
        admin.create_tenant(db, "big", rpm=2**31)
    with pytest.raises(InvalidInput):
        admin.create_tenant(db, "big", monthly_budget_usd="9223372036855")
    with pytest.raises(InvalidInput):
        admin.create_tenant(db, "nul\x00")
    with pytest.raises(InvalidInput):
        admin.set_price(db, "m", input_usd="1000001", cached_input_usd="0", output_usd="0")
    with pytest.raises(NotFound):
        admin.report(db, tenant="nul\x00")
    # the largest allowed values are stored and read back
    row = admin.create_tenant(db, "edge", rpm=2**31 - 1, monthly_budget_usd="9223372036854")
    assert (row["rpm"], row["monthly_budget_usd"]) == (2**31 - 1, "9223372036854")


@pytest.fixture
def pg_via_proxy(pg_database: Database) -> Iterator[tuple[Database, TcpProxy]]:
    """The session's PostgreSQL schema through a proxy the test can cut (an outage)."""
    empty(pg_database)
    url = pg_database.engine.url
    proxy = TcpProxy(url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    db = Database.connect(proxied)
    yield db, proxy
    proxy.close()
    db.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_known_keys_authenticate_through_a_database_outage(
    pg_via_proxy: tuple[Database, TcpProxy],
) -> None:
    db, proxy = pg_via_proxy
    key = admin.create_tenant(db, "through-outage")["api_key"]
    clock = Clock()
    auth_ = KeyAuthenticator(db, cache_ttl_s=5, stale_ttl_s=300, clock=clock)
    principal = auth_.authenticate(key)
    proxy.cut()
    clock.now += 60  # past the cache's freshness: the lookup fails, the last answer serves
    assert auth_.authenticate(key) == principal
    with pytest.raises(StoreUnavailable):  # never seen: no answer to fall back on
        auth_.authenticate("sk-never-seen-0123456789abcdef")
    clock.now += 300  # too old to trust
    with pytest.raises(StoreUnavailable):
        auth_.authenticate(key)


def test_static_keys_serve_through_an_outage_of_an_empty_tenant_store(
    pg_via_proxy: tuple[Database, TcpProxy],
) -> None:
    db, proxy = pg_via_proxy
    s = start_stack(db, MemoryQuotaStore, api_keys=["sk-static-outage"])
    try:
        url, headers = f"{s.urls[0]}/v1/chat/completions", auth("sk-static-outage")
        assert httpx.post(url, json=chat(4), headers=headers, timeout=10).status_code == 200
        proxy.cut()
        r = httpx.post(url, json=chat(4), headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        wrong = httpx.post(url, json=chat(4), headers=auth("sk-wrong"), timeout=30)
        assert wrong.status_code == 503  # not a static key: only the store could say
    finally:
        s.close()
