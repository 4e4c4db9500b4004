"""`sluice bench admission`: what auth + admission adds to each request, p50/p99.

Per request: `authenticate(bearer)` (in-process cache hit, as on a warm gateway) then
`admit(...)` (one Lua round trip on Redis; a lock and dict updates in-process), side by
side. Settlement (off the request path, from the terminal delta or the quotas consumer)
and a cold authentication (cache miss: one indexed SELECT on SQLite) are measured too.
Target: admission p99 <= 3 ms with Redis.

    .venv/bin/python -m benchmarks.admission [--redis redis://127.0.0.1:6379/15] [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile
from sluice.billing.admission import AdmissionService
from sluice.bus.messages import Usage
from sluice.bus.topics import Lane
from sluice.storage.db import Database, embedded_url
from sluice.storage.keys import KeyAuthenticator, KeyRepository
from sluice.storage.prices import PriceBook, PriceCache
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.quota_redis import RedisQuotaStore
from sluice.storage.quotas import QuotaStore
from sluice.storage.tenants import PlanLimits, TenantRepository

TARGET_P99_MS = 3.0
LIMITS = PlanLimits(rpm=10**7, tpm=10**9, max_concurrency=10**6, monthly_budget_micros=10**13)


def _ms(ns: int) -> float:
    return ns / 1e6


def _summary(samples_ns: list[int]) -> dict[str, float]:
    values = [_ms(v) for v in samples_ns]
    return {"p50_ms": round(percentile(values, 50), 4), "p99_ms": round(percentile(values, 99), 4)}


def measure(service: AdmissionService, api_key: str, n: int) -> dict[str, Any]:
    admit_ns: list[int] = []
    settle_ns: list[int] = []
    usage = Usage(prompt_tokens=200, cached_tokens=0, completion_tokens=50)
    for i in range(n + n // 10):  # the first tenth warms up and is not counted
        rid = f"bench-{i}"
        t0 = time.perf_counter_ns()
        principal = service.authenticate(f"Bearer {api_key}")
        decision = service.admit(principal, request_id=rid, model="bench-model",
                                 prompt_tokens=200, max_tokens=256)  # fmt: skip
        t1 = time.perf_counter_ns()
        assert decision.allowed, decision
        service.settle_terminal(tenant_id=principal.tenant_id, request_id=rid, attempt=0,
                                model="bench-model", lane=Lane.STANDARD, usage=usage)  # fmt: skip
        t2 = time.perf_counter_ns()
        if i >= n // 10:
            admit_ns.append(t1 - t0)
            settle_ns.append(t2 - t1)
    return {"admission": _summary(admit_ns), "settle": _summary(settle_ns), "requests": n}


def cold_auth(db: Database, api_key: str, n: int) -> dict[str, float]:
    samples = []
    for _ in range(n):
        auth = KeyAuthenticator(db)  # empty cache: every call reads the key row
        t0 = time.perf_counter_ns()
        auth.authenticate(api_key)
        samples.append(time.perf_counter_ns() - t0)
    return _summary(samples)


def run(redis_url: str | None = None, quick: bool = False) -> dict[str, Any]:
    """In-process always; Redis too when `redis_url` is given (keys under a random prefix)."""
    n = 2000 if quick else 10000
    result: dict[str, Any] = {"target_p99_ms": TARGET_P99_MS, "backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        db = Database.connect(embedded_url(Path(tmp)), migrate_if_needed=True)
        TenantRepository(db).create("bench", LIMITS)
        api_key = KeyRepository(db).create("bench").api_key
        PriceBook(db).set("bench-model", input_usd="0.15", cached_input_usd="0.075",
                          output_usd="0.6")  # fmt: skip
        stores: dict[str, QuotaStore] = {"in-process": MemoryQuotaStore()}
        if redis_url:
            prefix = f"sluice-bench-{uuid.uuid4().hex[:8]}"
            stores["redis"] = RedisQuotaStore(redis_url, prefix=prefix, timeout_s=2.0)
        for name, store in stores.items():
            service = AdmissionService(KeyAuthenticator(db), store, PriceCache(PriceBook(db)))
            result["backends"][name] = measure(service, api_key, n)
            if isinstance(store, RedisQuotaStore):
                keys = list(store.client.scan_iter(match=f"{store.prefix}:*"))
                if keys:
                    store.client.delete(*keys)
            store.close()
        result["cold_auth_sqlite"] = cold_auth(db, api_key, 200 if quick else 1000)
        db.close()
    if "redis" in result["backends"]:
        p99 = result["backends"]["redis"]["admission"]["p99_ms"]
        result["redis_meets_target"] = p99 <= TARGET_P99_MS
    return result


def render(result: dict[str, Any]) -> str:
    lines = [f"{'quota store':<12} {'admit p50':>10} {'admit p99':>10} "
             f"{'settle p50':>11} {'settle p99':>11}   (ms, auth cached)"]  # fmt: skip
    for name, row in result["backends"].items():
        a, s = row["admission"], row["settle"]
        lines.append(f"{name:<12} {a['p50_ms']:>10.3f} {a['p99_ms']:>10.3f} "
                     f"{s['p50_ms']:>11.3f} {s['p99_ms']:>11.3f}")  # fmt: skip
    cold = result["cold_auth_sqlite"]
    lines.append(f"cold auth (cache miss, SQLite): p50 {cold['p50_ms']:.3f} ms, "
                 f"p99 {cold['p99_ms']:.3f} ms")  # fmt: skip
    if "redis_meets_target" in result:
        verdict = "meets" if result["redis_meets_target"] else "MISSES"
        lines.append(f"redis admission p99 {verdict} the {result['target_p99_ms']} ms target")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--redis", default=None, help="Redis URL (default: in-process only)")
    parser.add_argument("--quick", action="store_true", help="2000 requests instead of 10000")
    parser.add_argument("--json", action="store_true", help="JSON output")
    args = parser.parse_args(argv)
    result = run(redis_url=args.redis, quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
