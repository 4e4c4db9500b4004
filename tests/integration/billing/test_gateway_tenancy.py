"""Tenancy across the whole flow: keys → admission → engine → usage → ledger, quotas, reports.

Two stores: embedded (SQLite + in-process quotas) and distributed (PostgreSQL + Redis).
The relation guaranteed for usage, per request attempt (docs/architecture.md §5.4):
- ledger row == the engine's UsageRecord, to the token;
- a finished request: the usage the client was told == the engine's record;
- a stream the client cut off: engine completion tokens >= tokens the client received
  (the engine keeps generating until the Cancel lands); the ledger bills the engine's.
So Σ ledger = Σ engine usage records = Σ client-told usage + Σ (engine - received) over
the cancelled streams.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from sluice.billing import admin
from sluice.cli import app as cli_app
from sluice.storage.db import Database, embedded_url
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.quota_redis import RedisQuotaStore
from sluice.storage.tables import UsageEntry
from tests.integration.billing.gateway_stack import MODEL, RedisProxy, Stack, start_stack
from tests.integration.storage.stores import empty
from tests.waiting import wait_until_async

RATE_HEADERS = {
    f"x-ratelimit-{kind}-{dim}"
    for kind in ("limit", "remaining", "reset")
    for dim in ("requests", "tokens")
}
PLAN: dict[str, Any] = {"rpm": 100_000, "tpm": 10_000_000}


@pytest.fixture(params=["embedded", "distributed"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Database, Any]]:
    """(database, quota store factory): SQLite + in-process, or PostgreSQL + Redis."""
    if request.param == "embedded":
        db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
        shared = MemoryQuotaStore()
        yield db, lambda: shared
        db.close()
        return
    pg: Database = request.getfixturevalue("pg_database")
    empty(pg)
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
    yield pg, lambda: RedisQuotaStore(url, prefix=prefix)


def _price(db: Database) -> None:
    admin.set_price(db, MODEL, input_usd="1", cached_input_usd="0.5", output_usd="2")


def chat(max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count tokens"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_concurrency_limit_holds_across_two_gateways(
    pg_database: Database, redis_url: str, redis_prefix: str
) -> None:
    empty(pg_database)
    _price(pg_database)
    tenant = admin.create_tenant(pg_database, "acme", max_concurrency=10, **PLAN)
    stack = start_stack(
        pg_database, lambda: RedisQuotaStore(redis_url, prefix=redis_prefix), gateways=2
    )
    try:
        stack.backend.gate.clear()  # admitted requests stay in flight
        responses = asyncio.run(_burst(stack, tenant["api_key"], 50))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * 10 + [429] * 40
        for r in responses:
            assert set(r.headers) >= RATE_HEADERS, r.headers
            if r.status_code == 429:
                error = r.json()["error"]
                assert error["code"] == "rate_limit_exceeded"
                assert r.headers["x-should-retry"] == "true"
                assert int(r.headers["retry-after"]) >= 1
        # every slot came back on the terminal deltas: ten more fit at once
        again = asyncio.run(_burst(stack, tenant["api_key"], 10))
        assert [r.status_code for r in again] == [200] * 10
    finally:
        stack.close()


async def _burst(stack: Stack, key: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, headers=auth(key)) as client:

        async def one(i: int) -> httpx.Response:
            url = f"{stack.urls[i % len(stack.urls)]}/v1/chat/completions"
            return await client.post(url, json=chat(4))

        tasks = [asyncio.create_task(one(i)) for i in range(n)]

        def answered() -> bool:
            codes = [t.result().status_code for t in tasks if t.done() and not t.exception()]
            unexpected = any(code not in (200, 429) for code in codes)
            if codes.count(429) >= n - 10 or unexpected:
                stack.backend.gate.set()  # the rest were admitted (or failed): let them end
            return all(t.done() for t in tasks)

        await wait_until_async(answered, 60, f"{n} answers")
        return [t.result() for t in tasks]


class Outcome:
    def __init__(self, request_id: str, tenant: str, kind: str) -> None:
        self.request_id, self.tenant, self.kind = request_id, tenant, kind
        self.told: tuple[int, int] | None = None  # (prompt, completion) the client was told
        self.received = 0  # completion tokens the client saw (one letter per token)
        self.headers: set[str] = set()


async def _one(client: httpx.AsyncClient, url: str, tenant: str, i: int) -> Outcome:
    kind = ("json", "stream", "cancel")[i % 3]
    if kind == "json":
        r = await client.post(url, json=chat(3 + i % 7))
        assert r.status_code == 200, r.text
        out = Outcome(r.headers["x-request-id"], tenant, kind)
        usage = r.json()["usage"]
        out.told = (usage["prompt_tokens"], usage["completion_tokens"])
        out.received = len(r.json()["choices"][0]["message"]["content"])
        out.headers = set(r.headers)
        return out
    # a cancelled stream asks for far more than the client reads, so that the disconnect
    # reaches the engine first (200 tokens at the fake's 3 ms/step ended as 'length' before
    # it did on the 2-core AVX2 VM, 24 streams at once)
    max_tokens = 2000 if kind == "cancel" else 3 + i % 7
    async with client.stream("POST", url, json=chat(max_tokens, stream=True)) as r:
        assert r.status_code == 200
        out = Outcome(r.headers["x-request-id"], tenant, kind)
        out.headers = set(r.headers)
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out.told = (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"])
            for choice in chunk["choices"]:
                out.received += len(choice["delta"].get("content") or "")
            if kind == "cancel" and out.received >= 3:
                break  # the client goes away mid-stream
    return out


async def _mixed(stack: Stack, keys: dict[str, str], n: int) -> list[Outcome]:
    limit = asyncio.Semaphore(24)
    clients = {t: httpx.AsyncClient(timeout=30, headers=auth(k)) for t, k in keys.items()}
    tenants = sorted(keys)

    async def run(i: int) -> Outcome:
        async with limit:
            tenant = tenants[i % 2]
            url = f"{stack.urls[0]}/v1/chat/completions"
            return await _one(clients[tenant], url, tenant, i)

    try:
        return await asyncio.gather(*(run(i) for i in range(n)))
    finally:
        for client in clients.values():
            await client.aclose()


def _ledger(db: Database) -> dict[str, UsageEntry]:
    with db.session() as session:
        rows = session.scalars(sa.select(UsageEntry)).all()
        session.expunge_all()
    return {r.request_id: r for r in rows}


@pytest.mark.slow
def test_ledger_equals_engine_usage_equals_what_clients_were_told(
    stores: tuple[Database, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    db, make_quotas = stores
    _price(db)
    a = admin.create_tenant(db, "tenant-a", **PLAN)
    b = admin.create_tenant(db, "tenant-b", **PLAN)
    stack = start_stack(db, make_quotas)
    try:
        n = 200
        outcomes = asyncio.run(_mixed(stack, {a["tenant_id"]: a["api_key"],
                                              b["tenant_id"]: b["api_key"]}, n))  # fmt: skip
        stack.wait(lambda: len(stack.tap.records) >= n, what="usage records")
        stack.wait(lambda: len(_ledger(db)) >= n, what="ledger rows")
        records = {u.request_id: u for u in stack.tap.records}
        ledger = _ledger(db)
        assert len(records) == len(ledger) == n
        for out in outcomes:
            record, row = records[out.request_id], ledger[out.request_id]
            assert out.headers >= RATE_HEADERS
            assert row.tenant_id == record.tenant_id == out.tenant
            assert (row.prompt_tokens, row.completion_tokens) == (
                record.prompt_tokens, record.completion_tokens,
            )  # fmt: skip
            if out.kind == "cancel":
                assert record.finish_reason == "abort"
                assert record.completion_tokens >= out.received >= 3
            else:
                assert out.told == (record.prompt_tokens, record.completion_tokens)
                assert out.received == record.completion_tokens
        for tenant in (a, b):
            mine = [o for o in outcomes if o.tenant == tenant["tenant_id"]]
            engine = sum(records[o.request_id].completion_tokens for o in mine)
            told = sum(o.told[1] for o in mine if o.told is not None)
            unseen = sum(records[o.request_id].completion_tokens - o.received
                         for o in mine if o.kind == "cancel")  # fmt: skip
            received_cancelled = sum(o.received for o in mine if o.kind == "cancel")
            assert engine == told + received_cancelled + unseen
            report = _cli_report(db, tenant["name"], monkeypatch)
            assert report["totals"]["completion_tokens"] == engine
            assert report["totals"]["requests"] == len(mine)
            usage = _own_usage(stack, tenant["api_key"])
            assert usage["tenant"] == tenant["tenant_id"]
            assert usage["totals"] == report["totals"]  # and never the other tenant's rows
    finally:
        stack.close()


def test_n_choices_bill_the_prompt_once_as_the_client_is_shown(
    stores: tuple[Database, Any],
) -> None:
    """n > 1 and several prompts: each distinct prompt once in `usage` and in the ledger,
    cached ≤ prompt, and the ledger's cost is the price of what the client was shown."""
    db, make_quotas = stores
    _price(db)
    tenant = admin.create_tenant(db, "n-choices", **PLAN)
    stack = start_stack(db, make_quotas)
    try:
        url, headers = stack.urls[0], auth(tenant["api_key"])
        bodies = [
            ("chat/completions", chat(5, n=8)),
            ("chat/completions", chat(5, n=8)),  # the prompt again: cache hits
            (
                "completions",
                {"model": MODEL, "prompt": ["one", "two two", "three"], "n": 2, "max_tokens": 4},
            ),
        ]
        shown = [0, 0, 0]
        subrequests = 0
        for path, body in bodies:
            r = httpx.post(f"{url}/v1/{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert 0 <= cached <= usage["prompt_tokens"]
            for i, value in enumerate((usage["prompt_tokens"], cached, usage["completion_tokens"])):
                shown[i] += value
            subrequests += len(r.json()["choices"])
        assert shown[1] > 0  # the second call's choices hit the cache
        stack.wait(lambda: len(_ledger(db)) >= subrequests, what="ledger rows")
        rows = list(_ledger(db).values())
        ledger = [sum(getattr(r, f) for r in rows)
                  for f in ("prompt_tokens", "cached_tokens", "completion_tokens")]  # fmt: skip
        assert ledger == shown
        # input 1 USD/M is 1e6 picos a token, cached 0.5, output 2
        expected = (shown[0] - shown[1]) * 1_000_000 + shown[1] * 500_000 + shown[2] * 2_000_000
        assert sum(r.cost_picos for r in rows) == expected
    finally:
        stack.close()


def _cli_report(db: Database, tenant: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    url = db.engine.url.render_as_string(hide_password=False)
    monkeypatch.setenv("SLUICE_DATABASE_URL", url)
    result = CliRunner().invoke(cli_app, ["billing", "report", "--tenant", tenant,
                                          "--format", "json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _own_usage(stack: Stack, key: str) -> dict[str, Any]:
    r = httpx.get(f"{stack.urls[0]}/v1/usage", headers=auth(key), timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.slow
def test_redis_outage_opens_rate_limits_with_a_local_cap_and_closes_budgets(
    pg_database: Database, redis_url: str, redis_prefix: str
) -> None:
    empty(pg_database)
    _price(pg_database)
    free = admin.create_tenant(pg_database, "free", max_concurrency=4, **PLAN)
    paid = admin.create_tenant(pg_database, "paid", monthly_budget_usd="100", **PLAN)
    proxy = RedisProxy()
    proxied = redis_url.replace(":6379", f":{proxy.port}")
    stack = start_stack(
        pg_database,
        lambda: RedisQuotaStore(proxied, prefix=redis_prefix, fallback_replicas=2),
    )
    url = f"{stack.urls[0]}/v1/chat/completions"
    try:
        for tenant in (free, paid):
            r = httpx.post(url, json=chat(3), headers=auth(tenant["api_key"]), timeout=10)
            assert r.status_code == 200, r.text
        proxy.cut()
        r = httpx.post(url, json=chat(3), headers=auth(paid["api_key"]), timeout=10)
        assert r.status_code == 503, (r.text, r.headers)
        assert r.json()["error"]["code"] == "quota_store_unavailable"
        assert r.headers["x-should-retry"] == "true" and int(r.headers["retry-after"]) >= 1
        stack.backend.gate.clear()
        responses = asyncio.run(_burst_one(url, free["api_key"], 4, stack))
        # concurrency 4 over 2 gateway replicas: this gateway alone admits 2
        assert sorted(r.status_code for r in responses) == [200, 200, 429, 429]
    finally:
        stack.close()


async def _burst_one(url: str, key: str, n: int, stack: Stack) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, headers=auth(key)) as client:
        tasks = [asyncio.create_task(client.post(url, json=chat(3))) for _ in range(n)]
        await wait_until_async(lambda: sum(t.done() for t in tasks) >= n // 2, 30, "the refusals")
        stack.backend.gate.set()
        return list(await asyncio.gather(*tasks))
