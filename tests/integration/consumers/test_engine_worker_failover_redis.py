"""Failover with the Redis progress store: two workers, two store clients, one Redis; the
first killed, or drained with the request still running at the deadline."""

from __future__ import annotations

import pytest

from sluice.consumers.progress import RedisProgressStore
from tests.integration.consumers.redis_progress import REDIS_URL, redis_progress_store
from tests.unit.consumers.failover import run_failover


@pytest.mark.parametrize("drain", [False, True], ids=["killed", "drained past its timeout"])
def test_a_dead_workers_stream_continues_from_redis_progress(drain: bool) -> None:
    for store_a in redis_progress_store():
        store_b = RedisProgressStore(REDIS_URL, prefix=store_a.prefix, ttl_s=60)
        try:
            run_failover(store_a, store_b, f"fo-redis-{drain}", drain=drain)
        finally:
            store_b.close()
