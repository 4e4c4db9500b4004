"""Failover with the Redis progress store: two workers, two store clients, one Redis."""

from __future__ import annotations

from consumers.progress import RedisProgressStore
from tests.integration.consumers.redis_progress import REDIS_URL, redis_progress_store
from tests.unit.consumers.failover import run_failover


def test_a_dead_workers_stream_continues_from_redis_progress() -> None:
    for store_a in redis_progress_store():
        store_b = RedisProgressStore(REDIS_URL, prefix=store_a.prefix, ttl_s=60)
        try:
            run_failover(store_a, store_b, "fo-redis")
        finally:
            store_b.close()
