"""Usage reports from the ledger: totals by model and by day, per tenant or for all.

Formats: a rich table, CSV (one row per total/model/day), JSON and a PNG report for a
slide: tokens per day by tenant (by prompt and completion for one tenant) over cost per
day and its running total, on a date axis that reads at any range (matplotlib's Agg
canvas, no display, no global pyplot state).
Costs are exact: summed in pico-dollars, shown in USD as decimal strings (never floats).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from decimal import Decimal
from pathlib import Path

from sluice.storage.usage import Report, Totals, format_usd

COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd")


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


# the tenants a chart names one by one; the rest are summed as "other tenants"
CHART_TENANTS = 8
_PALETTE = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#DD8452",
            "#937860", "#A0A0A0")  # fmt: skip


def _tenant_series(report: Report) -> list[tuple[str, dict[dt.date, int]]]:
    """Tokens per day of the tenants with the most tokens, the others summed last."""
    per: dict[str, dict[dt.date, int]] = {}
    for day, name, t in report.by_day_tenant:
        per.setdefault(name, {})[day] = t.prompt_tokens + t.completion_tokens
    ranked = sorted(per, key=lambda n: -sum(per[n].values()))
    series = [(name, per[name]) for name in ranked[:CHART_TENANTS]]
    if rest := ranked[CHART_TENANTS:]:
        other: dict[dt.date, int] = {}
        for name in rest:
            for day, tokens in per[name].items():
                other[day] = other.get(day, 0) + tokens
        series.append((f"{len(rest)} other tenants", other))
    return series


def render_png(report: Report, path: Path) -> None:
    """A 1600x900 report: tokens per day stacked by tenant (or, for one tenant, by prompt
    and completion) above cost per day and its running total; totals in the title."""
    import matplotlib.dates as mdates
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    figure = Figure(figsize=(12.8, 7.2), dpi=125)
    FigureCanvasAgg(figure)
    tokens_axes, cost_axes = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    days = [d for d, _ in report.by_day]
    x = [dt.datetime.combine(d, dt.time()) for d in days]  # a date axis, bars a day wide
    if report.tenant is None and report.by_day_tenant:
        layers = [(name, [per.get(d, 0) for d in days]) for name, per in _tenant_series(report)]
    else:
        layers = [
            ("prompt tokens", [t.prompt_tokens for _, t in report.by_day]),
            ("completion tokens", [t.completion_tokens for _, t in report.by_day]),
        ]
    bottom = [0] * len(days)
    for (label, values), color in zip(layers, _PALETTE, strict=False):
        tokens_axes.bar(x, values, width=0.8, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    tokens_axes.set_ylabel("tokens per day")
    tokens_axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    tokens_axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    cost = [float(t.cost_usd) for _, t in report.by_day]  # plotting only, never stored
    running = [sum(cost[: i + 1]) for i in range(len(cost))]
    cost_axes.bar(x, cost, width=0.8, color="#C44E52", label="cost per day")
    cost_axes.set_ylabel("USD per day")
    cost_axes.set_ylim(bottom=0)
    total_axes = cost_axes.twinx()
    total_axes.plot(x, running, color="#333333", marker="." if len(days) < 60 else None,
                    label="running total")  # fmt: skip
    total_axes.set_ylabel("USD, running total")
    total_axes.set_ylim(bottom=0)
    handles = cost_axes.get_legend_handles_labels()[0] + total_axes.get_legend_handles_labels()[0]
    cost_axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.08, 1.0), frameon=False)
    locator = mdates.AutoDateLocator(minticks=3, maxticks=12)  # type: ignore[no-untyped-call]
    cost_axes.xaxis.set_major_locator(locator)
    formatter = mdates.ConciseDateFormatter(locator)  # type: ignore[no-untyped-call]
    cost_axes.xaxis.set_major_formatter(formatter)
    if x:  # a few days of margin: one day is a bar, not the whole width
        margin = dt.timedelta(days=3)
        cost_axes.set_xlim(x[0] - margin, x[-1] + margin)
    for axes in (tokens_axes, cost_axes):
        axes.grid(axis="y", alpha=0.3)
        axes.set_axisbelow(True)
        axes.spines[["top"]].set_visible(False)
    t = report.totals
    first, last = (
        report.since or (days[0] if days else None),
        report.until or (days[-1] if days else None),
    )
    span = f"{first or 'start'} to {last or 'now'}"
    figure.suptitle(
        f"Usage: {report.tenant or 'all tenants'}, {span}\n"
        f"{t.requests:,} request{'s' if t.requests != 1 else ''} · {_short(t.prompt_tokens)}"
        f" prompt and {_short(t.completion_tokens)} completion tokens · USD {_usd(t.cost_usd)}",
        fontsize=13,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(path), format="png")


def _usd(value: Decimal) -> str:
    """Cents from a dollar up, else 3 significant digits: a slide's figure (the exact
    amount is in the other formats)."""
    if value >= 1:
        return f"{value:,.2f}"
    return format_usd(Decimal(f"{value:.3g}")) if value else "0.00"


def _short(value: float) -> str:
    """1234567 -> 1.2M: axis labels and titles a person reads at a glance."""
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.0f}"
