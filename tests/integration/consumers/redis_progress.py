"""A RedisProgressStore on the test Redis, with a key prefix no other test uses."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

from sluice.consumers.progress import RedisProgressStore
from tests.services import service_missing

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def redis_progress_store() -> Iterator[RedisProgressStore]:
    store = RedisProgressStore(REDIS_URL, prefix=f"test:{uuid.uuid4().hex[:8]}:", ttl_s=60)
    try:
        store.ping()
    except Exception as exc:
        store.close()
        service_missing(f"Redis at {REDIS_URL} does not answer: {exc}")
    yield store
    store.close()
