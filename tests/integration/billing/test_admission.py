"""The gateway's view: key → principal → admission → settlement, with the price book."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.billing.admission import open_admission
from sluice.bus.messages import Timings, Usage, UsageRecord
from sluice.bus.topics import Lane
from sluice.storage.db import Database, embedded_url
from sluice.storage.errors import AuthenticationFailed
from sluice.storage.keys import KeyRepository
from sluice.storage.prices import PriceBook
from sluice.storage.tenants import PlanLimits, TenantRepository


def test_embedded_admission_end_to_end(tmp_path: Path) -> None:
    service = open_admission(database_url=None, redis_url=None, data_dir=tmp_path)
    db = Database.connect(embedded_url(tmp_path))
    TenantRepository(db).create(
        "acme", PlanLimits(rpm=100, tpm=1000, max_concurrency=1, monthly_budget_micros=2_000)
    )
    key = KeyRepository(db).create("acme").api_key
    PriceBook(db).set("m", input_usd="1", cached_input_usd="0.5", output_usd="2")
    with pytest.raises(AuthenticationFailed):
        service.authenticate("Bearer sk-sluice-nope")
    principal = service.authenticate(f"Bearer {key}")
    first = service.admit(principal, request_id="r1", model="m", prompt_tokens=100, max_tokens=400)
    # estimate: 100 * $1/M + 400 * $2/M = 900 micro-dollars held against the 2000 budget
    assert first.allowed and first.remaining_tokens == 500
    second = service.admit(principal, request_id="r2", model="m", prompt_tokens=1, max_tokens=1)
    assert second.reason == "concurrency"
    usage = Usage(prompt_tokens=100, cached_tokens=50, completion_tokens=10)
    settled = service.settle_terminal(
        tenant_id=principal.tenant_id, request_id="r1", attempt=0, model="m",
        lane=Lane.STANDARD, usage=usage,
    )  # fmt: skip
    assert settled
    record = UsageRecord(
        request_id="r1", tenant_id=principal.tenant_id, model="m", lane=Lane.STANDARD,
        prompt_tokens=100, cached_tokens=50, completion_tokens=10, finish_reason="stop",
        timings=Timings(queued_ms=1, finished_ms=2),
    )  # fmt: skip
    assert not service.settler.settle_usage(record)  # the consumer's copy is a no-op
    third = service.admit(principal, request_id="r3", model="m", prompt_tokens=100, max_tokens=400)
    # 110 tokens used + 500 reserved; spend 50 + 25 + 20 = 95 micro-dollars + 900 held
    assert third.allowed and third.remaining_tokens == 390
    fourth_limits = service.admit(
        principal, request_id="r4", model="m", prompt_tokens=1, max_tokens=1
    )
    assert fourth_limits.reason == "concurrency"
    assert service.release(principal.tenant_id, "r3")
    big = service.admit(principal, request_id="r5", model="m", prompt_tokens=10, max_tokens=490)
    assert (big.allowed, big.reason) == (True, None)  # 95 + 990 <= 2000
    service.close()
    db.close()
