"""Where storage and billing tests find PostgreSQL and Redis, each run in its own namespace.

PostgreSQL: a schema per test session (search_path in the URL), dropped at the end.
Redis: db 15 (from $SLUICE_TEST_REDIS_URL) and a random key prefix per test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.tables import Base

DATABASE_URL = os.environ.get(
    "SLUICE_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def with_schema(url: str, schema: str) -> str:
    parsed = sa.engine.make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    return parsed.render_as_string(hide_password=False)


@contextmanager
def pg_schema(prefix: str = "sluice_test") -> Iterator[str]:
    """A fresh schema; yields a URL whose connections use it; drops it afterwards."""
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(DATABASE_URL, poolclass=sa.pool.NullPool)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        yield with_schema(DATABASE_URL, schema)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def empty(db: Database) -> None:
    with db.engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(sa.delete(table))


class FakeClock:
    """Milliseconds since the epoch, moved by hand; starts 10 s into a UTC month."""

    def __init__(self, now_ms: int = 1_767_225_610_000) -> None:  # 2026-01-01T00:00:10Z
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        self.now_ms += int(seconds * 1000)
