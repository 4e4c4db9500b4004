"""Reports: totals equal the usage fed in, to the token; tenants see only their rows."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections import defaultdict
from pathlib import Path

from sluice.billing.reports import render_csv, render_png, render_table
from sluice.storage.db import Database
from sluice.storage.ledger import UsageLedger, usage_day
from sluice.storage.usage import usage_report
from tests.integration.billing.test_consumers import ledger_snapshot, set_prices
from tests.integration.billing.usage_data import make_usages


def expected_totals(usages: list, tenant: str | None) -> dict[str, int]:  # type: ignore[type-arg]
    seen = {}
    for u in usages:
        if tenant is None or u.tenant_id == tenant:
            seen[(u.request_id, u.attempt)] = u
    return {
        "requests": len(seen),
        "prompt_tokens": sum(u.prompt_tokens for u in seen.values()),
        "cached_tokens": sum(u.cached_tokens for u in seen.values()),
        "completion_tokens": sum(u.completion_tokens for u in seen.values()),
    }


def test_report_totals_equal_the_usage_records_to_the_token(db: Database) -> None:
    set_prices(db)
    usages = make_usages(120, days=4)
    UsageLedger(db).record(usages)
    UsageLedger(db).record(usages[:30])  # duplicates do not count twice
    ledger_cost = sum(row[6] for row in ledger_snapshot(db))
    for tenant in (None, "ten_a", "ten_b"):
        report = usage_report(db, tenant_id=tenant)
        got = report.as_dict()["totals"]
        assert {k: got[k] for k in expected_totals(usages, tenant)} == expected_totals(
            usages, tenant
        )
        by_model = sum((t for _, t in report.by_model), start=type(report.totals)())
        by_day = sum((t for _, t in report.by_day), start=type(report.totals)())
        assert by_model == by_day == report.totals
    everything = usage_report(db, tenant_id=None)
    assert everything.totals.cost_picos == ledger_cost
    assert everything.totals.unpriced == sum(1 for r in ledger_snapshot(db) if not r[7])


def test_tenant_b_never_sees_tenant_a(db: Database) -> None:
    set_prices(db)
    usages = make_usages(60)
    UsageLedger(db).record(usages)
    only_b = usage_report(db, tenant_id="ten_b")
    assert only_b.totals.requests == len({u.request_id for u in usages if u.tenant_id == "ten_b"})
    a_cost = usage_report(db, tenant_id="ten_a").totals.cost_picos
    assert only_b.totals.cost_picos + a_cost == usage_report(db, tenant_id=None).totals.cost_picos
    assert usage_report(db, tenant_id="ten_nobody").totals.requests == 0


def test_date_range_is_inclusive_by_utc_day(db: Database) -> None:
    set_prices(db)
    usages = make_usages(90, days=3)
    UsageLedger(db).record(usages)
    day2 = dt.date(2026, 1, 2)
    report = usage_report(db, tenant_id="ten_a", since=day2, until=day2)
    per_day: dict[dt.date, set[str]] = defaultdict(set)
    for u in usages:
        if u.tenant_id == "ten_a":
            per_day[usage_day(u.timings.finished_ms)].add(u.request_id)
    assert [d for d, _ in report.by_day] == [day2]
    assert report.totals.requests == len(per_day[day2])


def test_formats(db: Database, tmp_path: Path) -> None:
    set_prices(db)
    UsageLedger(db).record(make_usages(30))
    report = usage_report(db, tenant_id="ten_a", tenant_label="acme")
    data = json.loads(json.dumps(report.as_dict()))
    assert set(data["totals"]) == {
        "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd",
    }  # fmt: skip
    assert data["tenant"] == "acme" and len(data["by_day"]) == 3
    rows = list(csv.DictReader(io.StringIO(render_csv(report))))
    assert rows[0]["section"] == "total"
    assert int(rows[0]["prompt_tokens"]) == report.totals.prompt_tokens
    assert {r["section"] for r in rows} == {"total", "model", "day"}
    assert "Usage by model" in render_table(report)
    png = tmp_path / "chart.png"
    render_png(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chart_breaks_days_down_by_tenant_and_reads_at_any_range(
    db: Database, tmp_path: Path
) -> None:
    from PIL import Image

    set_prices(db)
    tenants = tuple(f"ten_{i:02}" for i in range(11))  # more than the chart names
    UsageLedger(db).record(make_usages(400, tenants=tenants, days=90))
    everyone = usage_report(db, tenant_id=None)
    per_day: dict[dt.date, int] = defaultdict(int)
    for day, _, totals in everyone.by_day_tenant:
        per_day[day] += totals.prompt_tokens + totals.completion_tokens
    assert per_day == {d: t.prompt_tokens + t.completion_tokens for d, t in everyone.by_day}
    assert {name for _, name, _ in everyone.by_day_tenant} == set(tenants)
    one_day = everyone.by_day[0][0]
    for name, report in (
        ("90-days.png", everyone),
        ("one-day.png", usage_report(db, tenant_id=None, since=one_day, until=one_day)),
        ("tenant.png", usage_report(db, tenant_id="ten_03", tenant_label="acme")),
        ("empty.png", usage_report(db, tenant_id="ten_nobody")),
    ):
        png = tmp_path / name
        render_png(report, png)
        with Image.open(png) as image:
            assert image.size == (1600, 900), name
