"""Redis-only quota behaviour: atomicity across processes, and what an outage does."""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from multiprocessing.synchronize import Barrier

import pytest
import redis

from sluice.storage.errors import StoreUnavailable
from sluice.storage.quota_redis import RedisQuotaStore
from sluice.storage.quotas import Reservation, Settlement
from sluice.storage.tenants import PlanLimits
from tests.waiting import wait_until


def _admit_burst(
    url: str, prefix: str, worker: int, start: Barrier, out: multiprocessing.Queue[int]
) -> None:
    store = RedisQuotaStore(url, prefix=prefix, timeout_s=5.0)
    limits = PlanLimits(max_concurrency=10)
    allowed = 0
    lock = threading.Lock()

    def one(n: int) -> None:
        nonlocal allowed
        decision = store.admit(limits, Reservation("tenant", f"w{worker}-{n}", 0, 1, 0))
        with lock:
            allowed += decision.allowed

    threads = [threading.Thread(target=one, args=(n,)) for n in range(25)]
    start.wait(30)  # both processes connected, their threads made: all go at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    out.put(allowed)


def test_fifty_concurrent_admissions_from_two_processes_admit_exactly_ten(
    redis_url: str, redis_prefix: str
) -> None:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[int] = ctx.Queue()
    start = ctx.Barrier(2)
    procs = [
        ctx.Process(target=_admit_burst, args=(redis_url, redis_prefix, w, start, out))
        for w in range(2)
    ]
    for p in procs:
        p.start()
    counts = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert sum(counts) == 10, counts
    client = redis.Redis.from_url(redis_url)
    assert client.zcard(f"{redis_prefix}:{{tenant}}:leases") == 10
    client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def own_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of this test's own, on a free port, that the test may stop."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False

    wait_until(answers, 10, "redis-server to answer")
    client.close()
    yield url, proc
    if proc.poll() is None:
        proc.terminate()
    proc.wait(10)


def test_outage_fails_rate_limits_open_with_a_local_cap_and_budgets_closed(
    own_redis: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = own_redis
    store = RedisQuotaStore(url, fallback_replicas=2, retry_interval_s=0.2)
    rate_limited = PlanLimits(rpm=10, max_concurrency=20)
    budgeted = PlanLimits(rpm=10, monthly_budget_micros=10**9)
    healthy = store.admit(rate_limited, Reservation("a", "before", 0, 1, 0))
    assert healthy.allowed and not healthy.degraded
    assert store.admit(budgeted, Reservation("b", "before", 0, 1, 1)).allowed

    proc.terminate()  # our own redis-server, not the shared one
    proc.wait(10)

    local = [store.admit(rate_limited, Reservation("a", f"r{n}", 0, 1, 0)) for n in range(8)]
    assert all(d.degraded for d in local)
    # fail open, capped per process at the plan / replicas: rpm 10 / 2 = 5 (concurrency 10)
    assert [d.allowed for d in local] == [True] * 5 + [False] * 3
    assert {d.reason for d in local[5:]} == {"requests"}
    closed = store.admit(budgeted, Reservation("b", "during", 0, 1, 1))
    assert (closed.allowed, closed.reason, closed.degraded) == (False, "unavailable", True)
    assert closed.headers()["retry-after"] == "5"
    with pytest.raises(StoreUnavailable) as info:
        store.settle(Settlement("a", "before", 0, 1, 0))
    assert info.value.retryable
    store.close()


def test_a_closed_port_is_an_outage_too() -> None:
    store = RedisQuotaStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    open_decision = store.admit(PlanLimits(rpm=100), Reservation("a", "x", 0, 1, 0))
    closed_decision = store.admit(
        PlanLimits(monthly_budget_micros=5), Reservation("b", "y", 0, 1, 1)
    )
    assert open_decision.allowed and open_decision.degraded
    assert not closed_decision.allowed and closed_decision.reason == "unavailable"
    store.close()
