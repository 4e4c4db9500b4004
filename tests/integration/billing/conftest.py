"""Billing fixtures: a migrated database on SQLite and PostgreSQL, Redis namespaces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from billing import admin
from billing.db import Database, embedded_url, make_engine, migrate
from billing.health import check_database
from billing.models import Base
from billing.quota_memory import MemoryQuotaStore
from tests.integration.billing.gateway_stack import MODEL, Stack, start_stack
from tests.integration.billing.stores import DATABASE_URL, pg_schema
from tests.services import service_missing


@pytest.fixture(scope="session")
def pg_database() -> Iterator[Database]:
    """One migrated schema for the session; tests empty its tables before use."""
    try:
        check_database(DATABASE_URL)
    except Exception as exc:
        service_missing(f"PostgreSQL at {DATABASE_URL}: {exc}")
    with pg_schema() as url:
        engine = make_engine(url)
        migrate(engine)
        db = Database(engine)
        yield db
        db.close()


def empty(db: Database) -> None:
    with db.engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(sa.delete(table))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A migrated, empty billing database: embedded SQLite and real PostgreSQL."""
    if request.param == "postgresql":
        pg: Database = request.getfixturevalue("pg_database")
        empty(pg)
        yield pg
        return
    engine = make_engine(f"sqlite:///{tmp_path / 'sluice.db'}")
    migrate(engine)
    database = Database(engine)
    yield database
    database.close()


class FakeClock:
    """Milliseconds since the epoch, moved by hand; starts 10 s into a UTC month."""

    def __init__(self, now_ms: int = 1_767_225_610_000) -> None:  # 2026-01-01T00:00:10Z
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        self.now_ms += int(seconds * 1000)


@pytest.fixture(scope="session")
def redis_url() -> str:
    from billing.health import check_redis
    from tests.integration.billing.stores import REDIS_URL

    try:
        check_redis(REDIS_URL, timeout_s=1.0)
    except Exception as exc:
        service_missing(f"Redis at {REDIS_URL}: {exc}")
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test (or test run) uses; its keys are deleted afterwards."""
    import uuid

    import redis

    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


# The embedded (SQLite + in-process quotas) gateway stack with an admin key and a static key.
ADMIN = "sk-admin-test"
STATIC = "sk-static-test"


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    admin.set_price(db, MODEL, input_usd="1", cached_input_usd="0.5", output_usd="2")
    yield db
    db.close()


@pytest.fixture
def stack(sqlite_db: Database) -> Iterator[Stack]:
    store = MemoryQuotaStore()
    s = start_stack(sqlite_db, lambda: store, api_keys=[STATIC], admin_key=ADMIN)
    yield s
    s.close()
