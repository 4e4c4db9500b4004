"""Calls no wait can admit are 400s, and a spent budget answers before any rate limit."""

from __future__ import annotations

import httpx

from sluice.billing import admin
from sluice.storage.db import Database
from sluice.storage.quotas import Reservation
from sluice.storage.tenants import PlanLimits
from tests.integration.billing.gateway_stack import MODEL, Stack
from tests.integration.billing.test_gateway_tenancy import auth, chat


def test_more_prompts_than_concurrent_slots_is_a_400_naming_the_limit(
    stack: Stack, sqlite_db: Database
) -> None:
    tenant = admin.create_tenant(sqlite_db, "load", max_concurrency=16)
    url, headers = f"{stack.urls[0]}/v1/completions", auth(tenant["api_key"])
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    r = httpx.post(url, json={**body, "prompt": ["hi"] * 17}, headers=headers, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "max_concurrency" in error["message"] and "16" in error["message"]
    assert "retry-after" not in r.headers
    r = httpx.post(url, json={**body, "prompt": ["hi"] * 16}, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16


def test_a_call_reserving_more_than_the_tokens_per_minute_is_a_400(
    stack: Stack, sqlite_db: Database
) -> None:
    tenant = admin.create_tenant(sqlite_db, "small", tpm=1000)
    url, headers = f"{stack.urls[0]}/v1/chat/completions", auth(tenant["api_key"])
    r = httpx.post(url, json=chat(2000), headers=headers, timeout=10)
    assert r.status_code == 400, r.text
    assert "tpm" in r.json()["error"]["message"]
    assert httpx.post(url, json=chat(8), headers=headers, timeout=10).status_code == 200


def test_a_spent_budget_wins_over_a_full_concurrency_limit(
    stack: Stack, sqlite_db: Database
) -> None:
    tenant = admin.create_tenant(sqlite_db, "both", max_concurrency=1, monthly_budget_usd="1")
    limits = PlanLimits(max_concurrency=1, monthly_budget_micros=1_000_000)
    # one request in flight holds the only slot and an estimate of the whole budget
    held = Reservation(tenant["tenant_id"], "in-flight", 0, 10, 1_000_000)
    assert stack.services[0].quotas.admit(limits, held).allowed
    r = httpx.post(
        f"{stack.urls[0]}/v1/chat/completions", json=chat(8),
        headers=auth(tenant["api_key"]), timeout=10,
    )  # fmt: skip
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "insufficient_quota"
    assert r.headers["x-should-retry"] == "false"
    assert "retry-after" not in r.headers and "retry-after-ms" not in r.headers
