"""One contract suite for every QuotaStore: in-process and real Redis, same numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.quota_redis import RedisQuotaStore
from sluice.storage.quotas import QuotaStore, Reservation, Settlement, release
from sluice.storage.tenants import PlanLimits
from tests.integration.storage.stores import FakeClock

Make = Callable[..., QuotaStore]


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest) -> Iterator[Make]:
    stores: list[QuotaStore] = []

    def make(clock: FakeClock, **kwargs: float) -> QuotaStore:
        if request.param == "memory":
            store: QuotaStore = MemoryQuotaStore(clock_ms=clock, **kwargs)
        else:
            url = request.getfixturevalue("redis_url")
            prefix = request.getfixturevalue("redis_prefix")
            store = RedisQuotaStore(url, prefix=prefix, clock_ms=clock, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def res(rid: str, tokens: int = 10, cost: int = 0, tenant: str = "t1") -> Reservation:
    return Reservation(tenant, rid, 0, tokens, cost)


def settle(rid: str, tokens: int, cost: int = 0, tenant: str = "t1") -> Settlement:
    return Settlement(tenant, rid, 0, tokens, cost)


def test_requests_per_minute_with_headers_and_retry_after(make_store: Make) -> None:
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(rpm=3)
    decisions = [store.admit(limits, res(f"r{n}")) for n in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert [d.remaining_requests for d in decisions] == [2, 1, 0, 0]
    denied = decisions[3]
    assert denied.reason == "requests"
    assert denied.retry_after_s == pytest.approx(20.0)
    assert denied.headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "retry-after": "20",
    }
    assert decisions[0].headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "20s",
    }
    clock.advance(19.9)
    assert not store.admit(limits, res("r4")).allowed
    clock.advance(0.1)
    assert store.admit(limits, res("r5")).allowed
    assert store.admit(PlanLimits(rpm=3), res("other", tenant="t2")).allowed  # per tenant


def test_tokens_are_reserved_at_admission_and_settled_from_usage(make_store: Make) -> None:
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(tpm=1000)
    first = store.admit(limits, res("a", tokens=600))
    assert (first.allowed, first.remaining_tokens) == (True, 400)
    assert first.headers()["x-ratelimit-reset-tokens"] == "50s"
    denied = store.admit(limits, res("b", tokens=600))
    assert (denied.allowed, denied.reason) == (False, "tokens")
    assert denied.retry_after_s == pytest.approx(50.0)
    assert denied.headers()["x-ratelimit-remaining-tokens"] == "400"
    assert store.settle(settle("a", tokens=100))  # 500 of the 600 were never generated
    again = store.admit(limits, res("b", tokens=600))
    assert (again.allowed, again.remaining_tokens) == (True, 300)
    clock.advance(50)  # next minute window
    assert store.admit(limits, res("c", tokens=1000)).remaining_tokens == 0


def test_concurrency_acquired_at_admission_released_by_usage(make_store: Make) -> None:
    clock = FakeClock()
    store = make_store(clock, lease_s=600)
    limits = PlanLimits(max_concurrency=2)
    assert store.admit(limits, res("a")).allowed
    assert store.admit(limits, res("b")).allowed
    denied = store.admit(limits, res("c"))
    assert (denied.allowed, denied.reason, denied.retry_after_s) == (False, "concurrency", 1.0)
    assert store.settle(settle("a", tokens=5))
    assert store.admit(limits, res("c")).allowed
    assert release(store, "t1", "b", 0)
    assert store.admit(limits, res("d")).allowed
    assert not store.admit(limits, res("e")).allowed
    clock.advance(601)  # leases of requests whose usage never came expire
    assert store.admit(limits, res("e")).allowed


def test_monthly_budget_counts_spend_and_estimates_in_flight(make_store: Make) -> None:
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(monthly_budget_micros=1000)
    assert store.admit(limits, res("a", cost=600)).allowed
    denied = store.admit(limits, res("b", cost=600))
    assert (denied.allowed, denied.reason) == (False, "budget")
    assert denied.retry_after_s == pytest.approx(31 * 86400 - 10)  # January, 10 s in
    assert store.settle(settle("a", tokens=10, cost=300))
    assert store.admit(limits, res("b", cost=600)).allowed  # 300 spent + 600 held
    assert not store.admit(limits, res("c", cost=200)).allowed
    assert store.admit(limits, res("c", cost=100)).allowed  # exactly at the budget
    assert store.settle(settle("b", tokens=10, cost=700))
    assert store.settle(settle("c", tokens=10, cost=0))
    assert not store.admit(limits, res("d", cost=1)).allowed  # 1000 spent


def test_settlement_is_deduplicated_by_request_and_attempt(make_store: Make) -> None:
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(tpm=1000, monthly_budget_micros=1000, max_concurrency=5)
    assert store.admit(limits, res("a", tokens=500, cost=400)).allowed
    assert store.settle(settle("a", tokens=400, cost=400))
    for _ in range(3):
        assert not store.settle(settle("a", tokens=400, cost=400))  # replays
    # an attempt is its own record: a failover's second attempt is billed too
    assert store.settle(Settlement("t1", "a", 1, 100, 100))
    d = store.admit(limits, res("b", tokens=100, cost=500))
    assert (d.allowed, d.remaining_tokens) == (True, 400)  # 400 + 100 + 100 used
    assert not store.admit(limits, res("c", tokens=10, cost=1)).allowed  # 500 + 500 held


def test_an_attempts_own_settlement_replaces_an_estimated_one(make_store: Make) -> None:
    """A killed attempt settled first from the resumer's estimate, then from its own
    record: the store ends up as if only the own one had come, in either order."""
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(tpm=1000, monthly_budget_micros=1000)
    assert store.admit(limits, res("a", tokens=500, cost=500)).allowed
    assert store.settle(Settlement("t1", "a", 0, 100, 100, estimated=True))
    assert not store.settle(Settlement("t1", "a", 0, 100, 100, estimated=True))  # replay
    assert store.settle(Settlement("t1", "a", 0, 150, 300))  # own: +50 tokens, +200 spend
    assert not store.settle(Settlement("t1", "a", 0, 150, 300))
    assert not store.settle(Settlement("t1", "a", 0, 100, 100, estimated=True))
    assert store.settle(Settlement("t1", "b", 0, 50, 50))  # own first ...
    assert not store.settle(Settlement("t1", "b", 0, 40, 40, estimated=True))  # ... stays
    d = store.admit(limits, res("c", tokens=100, cost=650))
    assert (d.allowed, d.remaining_tokens) == (True, 700)  # 150 + 50 + 100 used
    assert not store.admit(limits, res("d", tokens=1, cost=1)).allowed  # 350 spent + 650


def test_a_denial_reserves_nothing(make_store: Make) -> None:
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(rpm=2, tpm=100, max_concurrency=1)
    assert not store.admit(limits, res("big", tokens=101)).allowed
    first = store.admit(limits, res("a", tokens=100))
    assert (first.allowed, first.remaining_requests, first.remaining_tokens) == (True, 1, 0)
    blocked = store.admit(limits, res("b", tokens=0))
    assert blocked.reason == "concurrency"
    assert blocked.remaining_requests == 1  # the denied request took no rpm slot


def test_unlimited_tenants_get_no_ratelimit_headers(make_store: Make) -> None:
    store = make_store(FakeClock())
    decision = store.admit(PlanLimits(), res("a", tokens=10**9, cost=10**12))
    assert decision.allowed and decision.headers() == {}
    zero = store.admit(PlanLimits(rpm=0), res("b"))
    assert (zero.allowed, zero.reason) == (False, "requests")


def test_a_spent_budget_outranks_a_rate_limit_denied_with_it(make_store: Make) -> None:
    """Concurrency and budget both full: the answer is the budget (not retried), without a
    retry-after of the weeks left in the month."""
    clock = FakeClock()
    store = make_store(clock)
    limits = PlanLimits(rpm=60, max_concurrency=1, monthly_budget_micros=1000)
    assert store.admit(limits, res("a", cost=1000)).allowed
    both = store.admit(limits, res("b", cost=1))
    assert (both.allowed, both.reason) == (False, "budget")
    assert both.retry_after_s == pytest.approx(31 * 86400 - 10)  # the budget resets then
    assert "retry-after" not in both.headers()
    assert both.headers()["x-ratelimit-limit-requests"] == "60"
    assert store.settle(settle("a", tokens=10, cost=0))  # budget free again
    assert store.admit(limits, res("c", cost=1)).allowed
    rate_only = store.admit(limits, res("d", cost=1))
    assert (rate_only.reason, rate_only.headers()["retry-after"]) == ("concurrency", "1")
