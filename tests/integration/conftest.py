"""Store fixtures for every integration test: a migrated database on SQLite and
PostgreSQL, Redis namespaces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.storage.db import Database, make_engine, migrate
from sluice.storage.health import check_database
from tests.integration.storage.stores import DATABASE_URL, empty, pg_schema
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


@pytest.fixture(scope="session")
def redis_url() -> str:
    from sluice.storage.health import check_redis
    from tests.integration.storage.stores import REDIS_URL

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
