"""Usage reports from the ledger: totals by model and by day, per tenant or for all.

Formats: a rich table, CSV (one row per total/model/day), JSON and a PNG chart of
tokens and cost per day (matplotlib's Agg canvas, no display, no global pyplot state).
Costs are exact: summed in pico-dollars, shown in USD as decimal strings (never floats).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from billing.db import Database
from billing.models import UsageEntry
from billing.prices import picos_to_usd

_SUMS = (
    sa.func.count().label("requests"),
    sa.func.coalesce(sa.func.sum(UsageEntry.prompt_tokens), 0).label("prompt_tokens"),
    sa.func.coalesce(sa.func.sum(UsageEntry.cached_tokens), 0).label("cached_tokens"),
    sa.func.coalesce(sa.func.sum(UsageEntry.completion_tokens), 0).label("completion_tokens"),
    sa.func.coalesce(sa.func.sum(UsageEntry.cost_picos), 0).label("cost_picos"),
    sa.func.coalesce(sa.func.sum(sa.case((UsageEntry.priced, 0), else_=1)), 0).label("unpriced"),
)
COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd")


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
    totals = sum((t for _, t in by_model), Totals())
    return Report(tenant_label or tenant_id, since, until, totals, by_model, by_day)


def _as_date(value: Any) -> dt.date:
    return value if isinstance(value, dt.date) else dt.date.fromisoformat(str(value))


def _safe_cell(value: str) -> str:
    """No spreadsheet formula injection from model names (OWASP CSV injection)."""
    return f"'{value}" if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def render_csv(report: Report) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["section", "key", *COLUMNS])
    rows: list[tuple[str, str, Totals]] = [("total", report.tenant or "all", report.totals)]
    rows += [("model", m, t) for m, t in report.by_model]
    rows += [("day", d.isoformat(), t) for d, t in report.by_day]
    for section, key, totals in rows:
        values = totals.as_dict()
        writer.writerow([section, _safe_cell(key), *(values[c] for c in COLUMNS)])
    return out.getvalue()


def render_table(report: Report, width: int = 120) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=width, file=io.StringIO())
    scope = report.tenant or "all tenants"
    span = f"{report.since or 'start'} .. {report.until or 'now'}"
    for title, rows in (
        (f"Usage by model: {scope}, {span}", [(m, t) for m, t in report.by_model]),
        (f"Usage by day: {scope}, {span}", [(d.isoformat(), t) for d, t in report.by_day]),
    ):
        table = Table(title=title)
        table.add_column("model" if "model" in title else "day")
        for column in COLUMNS:
            table.add_column(column, justify="right")
        for key, totals in [*rows, ("total", report.totals)]:
            values = totals.as_dict()
            table.add_row(key, *(f"{values[c]:,}" if c != "cost_usd" else values[c]
                                 for c in COLUMNS))  # fmt: skip
        console.print(table)
    if report.totals.unpriced:
        console.print(f"{report.totals.unpriced} requests had no price in the price book")
    return console.export_text()


def render_png(report: Report, path: Path) -> None:
    """Bars: prompt and completion tokens per day; line: cost per day (USD)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    days = [d.isoformat() for d, _ in report.by_day]
    prompt = [t.prompt_tokens for _, t in report.by_day]
    completion = [t.completion_tokens for _, t in report.by_day]
    cost = [float(t.cost_usd) for _, t in report.by_day]  # plotting only, never stored
    figure = Figure(figsize=(max(6.0, 0.6 * len(days) + 3), 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    positions = list(range(len(days)))
    axes.bar(positions, prompt, label="prompt tokens", color="#4C72B0")
    axes.bar(positions, completion, bottom=prompt, label="completion tokens", color="#55A868")
    axes.set_xticks(positions, days, rotation=45, ha="right")
    axes.set_ylabel("tokens")
    cost_axes = axes.twinx()
    cost_axes.plot(positions, cost, color="#C44E52", marker="o", label="cost (USD)")
    cost_axes.set_ylabel("cost (USD)")
    cost_axes.set_ylim(bottom=0)
    axes.set_title(f"Tokens and cost per day: {report.tenant or 'all tenants'}")
    handles = axes.get_legend_handles_labels()[0] + cost_axes.get_legend_handles_labels()[0]
    axes.legend(handles=handles, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(path), format="png")
