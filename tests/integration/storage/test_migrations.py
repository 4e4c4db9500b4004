"""Migrations run forward, back and forward again on PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from sluice.storage.db import downgrade, is_current, make_engine, migrate
from sluice.storage.health import check_database
from tests.integration.storage.stores import DATABASE_URL, pg_schema
from tests.services import service_missing

TABLES = {"plans", "tenants", "api_keys", "model_prices", "usage_ledger", "files", "batches"}
TABLES |= {"batch_lines", "responses", "response_events", "lora_adapters"}


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


def round_trip(engine: sa.Engine) -> None:
    assert tables(engine) == set()
    migrate(engine)
    assert tables(engine) == TABLES
    assert is_current(engine)
    downgrade(engine, "base")
    assert tables(engine) == set()
    assert not is_current(engine)
    migrate(engine)
    assert tables(engine) == TABLES
    assert is_current(engine)
    columns = {c["name"] for c in sa.inspect(engine).get_columns("usage_ledger")}
    assert {"request_id", "attempt", "cost_picos", "cached_tokens", "usage_day"} <= columns
    pk = sa.inspect(engine).get_pk_constraint("usage_ledger")
    assert pk["constrained_columns"] == ["request_id", "attempt"]
    assert "allowed_models" in {c["name"] for c in sa.inspect(engine).get_columns("tenants")}


def test_migrations_round_trip_on_a_fresh_postgresql_schema() -> None:
    try:
        check_database(DATABASE_URL)
    except Exception as exc:
        service_missing(f"PostgreSQL at {DATABASE_URL}: {exc}")
    with pg_schema("sluice_migrate") as url:
        engine = make_engine(url)
        try:
            round_trip(engine)
        finally:
            engine.dispose()


def test_migrations_round_trip_on_sqlite(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'nested' / 'sluice.db'}")
    round_trip(engine)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    engine.dispose()


@pytest.mark.parametrize("revision", ["head"])
def test_migrating_twice_is_a_no_op(tmp_path: Path, revision: str) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'sluice.db'}")
    migrate(engine, revision)
    migrate(engine, revision)
    assert tables(engine) == TABLES
    engine.dispose()


def _migrate_embedded(path: str) -> None:
    from sluice.storage.db import ensure_migrated

    ensure_migrated(make_engine(f"sqlite:///{path}"))


def test_processes_starting_together_migrate_an_embedded_database_once(tmp_path: Path) -> None:
    """`sluice up` starts the billing and quota workers at once on one embedded database;
    the second to migrate used to fail ("table model_prices already exists")."""
    import multiprocessing

    path = str(tmp_path / "sluice.db")
    procs = [
        multiprocessing.get_context("fork").Process(target=_migrate_embedded, args=(path,))
        for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * 4
    engine = make_engine(f"sqlite:///{path}")
    assert tables(engine) == TABLES and is_current(engine)
