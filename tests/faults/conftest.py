"""Fixtures of the fault suites: the services a `benchmarks.faults` fleet needs."""

from __future__ import annotations

import shutil

import pytest

from tests.services import service_missing


@pytest.fixture(scope="module")
def fleet_services() -> None:
    """PostgreSQL at `benchmarks.faults.ADMIN_URL`, and `redis-server` on PATH (each fleet
    runs a Redis of its own); a missing one fails the test in CI and skips it elsewhere."""
    import sqlalchemy as sa

    from benchmarks.faults import ADMIN_URL

    try:
        engine = sa.create_engine(ADMIN_URL)
        with engine.connect():
            pass
        engine.dispose()
    except Exception as exc:
        service_missing(f"PostgreSQL at {ADMIN_URL}: {exc}")
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not on PATH")
