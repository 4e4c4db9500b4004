"""The usage ledger: one row per (request_id, attempt), priced at write, idempotent.

`UsageLedger.record` inserts a batch of usage records in one transaction with
`INSERT … ON CONFLICT (request_id, attempt) DO UPDATE … WHERE` the stored row is an
estimate and the new one is not (PostgreSQL and SQLite alike): a replayed or redelivered
record changes nothing, and an attempt's own record replaces the estimate a resuming
worker published for it (`UsageRecord.estimated`). The price is read in the same
transaction. A model missing from the price book is recorded with cost 0 and
`priced = false` (never dropped: the tokens are still billed facts; reports count them),
with one warning per model per process.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from sluice.bus.messages import UsageRecord
from sluice.bus.topics import Lane
from sluice.storage.db import Database
from sluice.storage.prices import Price, load_prices
from sluice.storage.tables import UsageEntry, utcnow

logger = logging.getLogger(__name__)
LEDGER: sa.Table = UsageEntry.__table__  # type: ignore[assignment]

# models already warned about: an unpriced model would otherwise log on every request
_warned_unpriced: set[str] = set()


def is_batch(usage: UsageRecord) -> bool:
    return usage.lane == Lane.BATCH or usage.batch_id is not None


def usage_day(finished_ms: int) -> dt.date:
    return dt.datetime.fromtimestamp(finished_ms / 1000, dt.UTC).date()


def _one_per_attempt(usages: Sequence[UsageRecord]) -> list[UsageRecord]:
    """One record per (request_id, attempt) of a batch, an attempt's own over an estimate
    (one statement may not touch a row twice)."""
    kept: dict[tuple[str, int], UsageRecord] = {}
    for usage in usages:
        key = (usage.request_id, usage.attempt)
        if key not in kept or (kept[key].estimated and not usage.estimated):
            kept[key] = usage
    return list(kept.values())


def ledger_row(usage: UsageRecord, price: Price | None) -> dict[str, Any]:
    cost = (
        price.cost_picos(
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            batch=is_batch(usage),
        )
        if price is not None
        else 0
    )
    t = usage.timings
    return {
        "request_id": usage.request_id,
        "attempt": usage.attempt,
        "tenant_id": usage.tenant_id,
        "key_id": usage.key_id,
        "model": usage.model,
        "lane": usage.lane.value,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "completion_tokens": usage.completion_tokens,
        "cost_picos": cost,
        "priced": price is not None,
        "finish_reason": usage.finish_reason,
        "queued_ms": t.queued_ms,
        "scheduled_ms": t.scheduled_ms,
        "first_token_ms": t.first_token_ms,
        "finished_ms": t.finished_ms,
        "usage_day": usage_day(t.finished_ms),
        "batch_id": usage.batch_id,
        "recorded_at": utcnow(),
        "estimated": usage.estimated,
    }


@dataclass(frozen=True, slots=True)
class PeriodSpend:
    """A tenant's billing period (a calendar month, UTC), computed from the ledger."""

    tenant_id: str
    month: str  # YYYY-MM
    requests: int
    cost_picos: int


class UsageLedger:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, usages: Sequence[UsageRecord]) -> int:
        """Insert in one committed transaction; returns how many rows were new or replaced
        an estimate."""
        usages = _one_per_attempt(usages)
        if not usages:
            return 0
        with self.db.session() as session:
            prices = load_prices(session)
            rows = [ledger_row(u, prices.get(u.model)) for u in usages]
            for usage in usages:
                if usage.model not in prices and usage.model not in _warned_unpriced:
                    _warned_unpriced.add(usage.model)
                    logger.warning(
                        "no price for model=%s (first request_id=%s tenant_id=%s): recorded "
                        "unpriced until `sluice prices set`; not repeated for this model",
                        usage.model,
                        usage.request_id,
                        usage.tenant_id,
                    )
            insert = postgresql.insert if self.db.dialect == "postgresql" else sqlite.insert
            values = insert(LEDGER).values(rows)
            key = ("request_id", "attempt")
            statement = values.on_conflict_do_update(
                index_elements=list(key),
                set_={c: values.excluded[c] for c in rows[0] if c not in key},
                where=LEDGER.c.estimated & ~values.excluded.estimated,
            ).returning(LEDGER.c.request_id)
            # RETURNING yields the rows inserted or replaced (rowcount is unreliable here).
            return len(session.connection().execute(statement).all())

    def period_spend(self, tenant_id: str, month: dt.date) -> PeriodSpend:
        """Spend in the calendar month containing `month` (one index range scan)."""
        start = month.replace(day=1)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        with self.db.session() as session:
            count, picos = session.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(UsageEntry.cost_picos), 0))
                .where(UsageEntry.tenant_id == tenant_id)
                .where(UsageEntry.usage_day >= start, UsageEntry.usage_day < end)
            ).one()
        return PeriodSpend(tenant_id, start.strftime("%Y-%m"), int(count), int(picos))
