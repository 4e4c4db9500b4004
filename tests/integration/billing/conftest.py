"""Billing fixtures: a migrated database on SQLite and PostgreSQL, Redis namespaces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from billing.db import Database, make_engine, migrate
from billing.health import check_database
from billing.models import Base
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
