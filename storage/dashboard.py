"""The live dashboard's ledger and batch queries: tokens and spend per tenant for a day,
batches in progress.

Read by `/dashboard/data` (api/routes/dashboard.py). Spend is the ledger's `cost_picos`,
priced when each usage was billed, summed exactly as the usage reports (`storage.usage`)
sum it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from sluice.storage.batches import RUNNING, BatchInfo, BatchStore
from sluice.storage.db import Database
from sluice.storage.tables import Tenant, UsageEntry
from sluice.storage.usage import _SUMS, Totals


@dataclass(frozen=True, slots=True)
class TenantDay:
    """One tenant's usage on one UTC day; `name` is None for a tenant only the ledger knows
    (the static keys' `default`)."""

    tenant_id: str
    name: str | None
    totals: Totals

    def as_dict(self) -> dict[str, Any]:
        totals = self.totals.as_dict()
        tokens = self.totals.prompt_tokens + self.totals.completion_tokens
        return {"tenant_id": self.tenant_id, "name": self.name, **totals, "total_tokens": tokens}


def tenant_usage_on(db: Database, day: dt.date) -> list[TenantDay]:
    """Every tenant with usage on `day`, the largest spend first (then most tokens)."""
    query = (
        sa.select(UsageEntry.tenant_id, Tenant.name, *_SUMS)
        .outerjoin(Tenant, Tenant.id == UsageEntry.tenant_id)
        .where(UsageEntry.usage_day == day)
        .group_by(UsageEntry.tenant_id, Tenant.name)
    )
    with db.session() as session:
        rows = [
            TenantDay(str(row[0]), row[1], Totals(*(int(v) for v in row[2:])))
            for row in session.execute(query)
        ]
    return sorted(
        rows,
        key=lambda r: (-r.totals.cost_picos,
                       -(r.totals.prompt_tokens + r.totals.completion_tokens), r.tenant_id),
    )  # fmt: skip


def batches_in_progress(store: BatchStore, limit: int = 50) -> list[BatchInfo]:
    """Batches not yet finished (validating, in progress, finalizing, cancelling), oldest
    first, at most `limit`."""
    running = store.batches_with_status(RUNNING)
    return sorted(running, key=lambda b: (b.created_at, b.id))[:limit]
