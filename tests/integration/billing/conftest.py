"""Billing fixtures: the embedded gateway stack with an admin key and a static key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.billing import admin
from sluice.storage.db import Database, embedded_url
from sluice.storage.quota_memory import MemoryQuotaStore
from tests.integration.billing.gateway_stack import MODEL, Stack, start_stack

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
