"""Usage totals from the ledger: by model, by day, and by day and tenant.

`_SUMS` is the one aggregate every query uses (the dashboard's too), so a report and
the live page add tokens and cost the same way; costs are summed in pico-dollars.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.prices import picos_to_usd
from sluice.storage.tables import Tenant, UsageEntry

_SUMS = (
    sa.func.count().label("requests"),
    sa.func.coalesce(sa.func.sum(UsageEntry.prompt_tokens), 0).label("prompt_tokens"),
    sa.func.coalesce(sa.func.sum(UsageEntry.cached_tokens), 0).label("cached_tokens"),
    sa.func.coalesce(sa.func.sum(UsageEntry.completion_tokens), 0).label("completion_tokens"),
    sa.func.coalesce(sa.func.sum(UsageEntry.cost_picos), 0).label("cost_picos"),
    sa.func.coalesce(sa.func.sum(sa.case((UsageEntry.priced, 0), else_=1)), 0).label("unpriced"),
)


@dataclass(frozen=True, slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_picos: int = 0
    unpriced: int = 0

    @property
    def cost_usd(self) -> Decimal:
        return picos_to_usd(self.cost_picos)

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_usd": format_usd(self.cost_usd),
        }


def _values(t: Totals) -> tuple[int, ...]:
    return (t.requests, t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.cost_picos,
            t.unpriced)  # fmt: skip


def format_usd(value: Decimal) -> str:
    """Exact, plain notation, at least 2 decimals: `0.000375`, `12.50`."""
    text = format(value.normalize(), "f")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


@dataclass(frozen=True, slots=True)
class Report:
    tenant: str | None
    since: dt.date | None
    until: dt.date | None
    totals: Totals
    by_model: list[tuple[str, Totals]] = field(default_factory=list)
    by_day: list[tuple[dt.date, Totals]] = field(default_factory=list)
    # (day, tenant name, totals): a report over every tenant, for the chart
    by_day_tenant: list[tuple[dt.date, str, Totals]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "totals": self.totals.as_dict(),
            "by_model": [{"model": m, **t.as_dict()} for m, t in self.by_model],
            "by_day": [{"day": d.isoformat(), **t.as_dict()} for d, t in self.by_day],
            "unpriced_requests": self.totals.unpriced,
        }


def usage_report(
    db: Database,
    *,
    tenant_id: str | None,
    since: dt.date | None = None,
    until: dt.date | None = None,
    tenant_label: str | None = None,
) -> Report:
    """Totals for one tenant (or every tenant when `tenant_id` is None), days inclusive."""
    where: list[sa.ColumnElement[bool]] = []
    if tenant_id is not None:
        where.append(UsageEntry.tenant_id == tenant_id)
    if since is not None:
        where.append(UsageEntry.usage_day >= since)
    if until is not None:
        where.append(UsageEntry.usage_day <= until)
    with db.session() as session:
        by_model = [
            (str(row[0]), Totals(*(int(v) for v in row[1:])))
            for row in session.execute(
                sa.select(UsageEntry.model, *_SUMS).where(*where)
                .group_by(UsageEntry.model).order_by(UsageEntry.model)
            )
        ]  # fmt: skip
        by_day = [
            (_as_date(row[0]), Totals(*(int(v) for v in row[1:])))
            for row in session.execute(
                sa.select(UsageEntry.usage_day, *_SUMS).where(*where)
                .group_by(UsageEntry.usage_day).order_by(UsageEntry.usage_day)
            )
        ]  # fmt: skip
        by_day_tenant = []
        if tenant_id is None:
            name = sa.func.coalesce(Tenant.name, UsageEntry.tenant_id)
            by_day_tenant = [
                (_as_date(row[0]), str(row[1]), Totals(*(int(v) for v in row[2:])))
                for row in session.execute(
                    sa.select(UsageEntry.usage_day, name, *_SUMS)
                    .outerjoin(Tenant, Tenant.id == UsageEntry.tenant_id).where(*where)
                    .group_by(UsageEntry.usage_day, name).order_by(UsageEntry.usage_day, name)
                )
            ]  # fmt: skip
    totals = sum((t for _, t in by_model), Totals())
    return Report(tenant_label or tenant_id, since, until, totals, by_model, by_day, by_day_tenant)


def _as_date(value: Any) -> dt.date:
    return value if isinstance(value, dt.date) else dt.date.fromisoformat(str(value))
