"""`/dashboard` and `/dashboard/data`: the shell, the admin key, numbers from Prometheus text,
the ledger's tenants today, batches in progress; and the Grafana dashboard's JSON."""

from __future__ import annotations

import datetime as dt
import json
import math
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice.api.app import create_app
from sluice.api.dashboard_data import (
    ScrapeHistory,
    histogram_quantile,
    parse_scrape,
    queue_depth,
    scrape_all,
)
from sluice.api.routes import admin as admin_routes
from sluice.api.routes.dashboard import DashboardState
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import Lane, request_topic
from sluice.storage.batches import BatchStore
from sluice.storage.dashboard import tenant_usage_on
from sluice.storage.db import Database, embedded_url
from sluice.storage.ledger import UsageLedger
from sluice.storage.prices import PriceBook
from sluice.storage.usage import usage_report
from tests.integration.billing.usage_data import START_MS, make_usages
from tests.services import service_missing
from tests.unit.api.conftest import gateway_settings
from tests.unit.api.fakes import served_model

ADMIN = "sk-admin-dashboard"
PEER = "http://peer.test/metrics"
REPO = Path(__file__).resolve().parents[3]


def ttft_text(counts: tuple[int, int, int, int], *, tokens: int = 0, lag: int = 0) -> str:
    """One engine's exposition: TTFT buckets 0.1/0.5/1/+Inf (cumulative), tokens, lag."""
    le = ("0.1", "0.5", "1.0", "+Inf")
    buckets = "\n".join(
        f'vllm:time_to_first_token_seconds_bucket{{model_name="m",le="{b}"}} {c}'
        for b, c in zip(le, counts, strict=True)
    )
    interactive, standard = request_topic(Lane.INTERACTIVE, "m"), request_topic(Lane.STANDARD, "m")
    return f"""# TYPE vllm:time_to_first_token_seconds histogram
{buckets}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {counts[-1]}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{model_name="m"}} {tokens}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} 0.25
# TYPE sluice_consumer_lag_records gauge
sluice_consumer_lag_records{{group="engine.m",topic="{interactive}"}} {lag}
sluice_consumer_lag_records{{group="audit",topic="{interactive}"}} 1
sluice_consumer_lag_records{{group="engine.m",topic="{standard}"}} 7
sluice_consumer_lag_records{{group="billing",topic="sluice.usage.v1"}} 4
"""


# -- the numbers -----------------------------------------------------------------------
def test_quantiles_interpolate_inside_the_bucket_like_prometheus() -> None:
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.95)  # 0.5 + 0.5 * 9/10
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)
    # a rank in +Inf answers the highest finite bound; no observations, no answer
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == pytest.approx(0.1)
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None


def test_queue_depth_sums_each_request_topic_over_its_groups() -> None:
    scrape = parse_scrape(ttft_text((0, 0, 0, 0), lag=5))
    assert queue_depth([scrape]) == {"interactive": 6.0, "standard": 7.0, "batch": None}
    assert queue_depth([scrape, scrape])["interactive"] == 12.0  # two processes
    other = request_topic(Lane.INTERACTIVE, "other")  # another model pool's lane: summed in
    text = f'sluice_consumer_lag_records{{group="engine.other",topic="{other}"}} 3\n'
    assert queue_depth([scrape, parse_scrape(text)])["interactive"] == 9.0


def test_percentiles_use_bucket_deltas_of_the_window_and_rates_the_last_two_polls() -> None:
    history = ScrapeHistory(window_s=300)
    # before the window: 1000 slow first tokens that must not weigh on the percentiles
    history.add(0.0, {"a": parse_scrape(ttft_text((0, 0, 1000, 1000), tokens=100))})
    first = history.summary()
    assert first["tokens_per_s"] is None and first["latency"]["window_s"] == 0
    assert first["latency"]["ttft_s"]["count"] == 1000  # one poll: counts since start
    history.add(2.0, {"a": parse_scrape(ttft_text((50, 90, 1100, 1100), tokens=300))})
    summary = history.summary()
    ttft = summary["latency"]["ttft_s"]
    assert ttft["count"] == 100 and summary["latency"]["window_s"] == 2.0
    assert ttft["p50"] == pytest.approx(0.1) and ttft["p99"] == pytest.approx(0.95)
    assert summary["tokens_per_s"] == pytest.approx(100.0)
    # another page polling 0.1 s later: the rate still spans at least 1.5 s
    history.add(2.1, {"a": parse_scrape(ttft_text((50, 90, 1100, 1100), tokens=310))})
    assert history.summary()["tokens_per_s"] == pytest.approx(210 / 2.1)
    assert summary["requests"] == {"running": 3.0, "waiting": 2.0}
    assert summary["kv_cache_usage"] == pytest.approx(0.25)
    assert summary["latency"]["itl_s"] == {
        "p50": None,
        "p99": None,
        "count": 0,
        "since_start": True,
    }
    assert not ttft["since_start"] and first["latency"]["ttft_s"]["since_start"]


def test_a_restarted_source_counts_from_zero_and_old_polls_leave_the_window() -> None:
    history = ScrapeHistory(window_s=10)
    history.add(0.0, {"a": parse_scrape(ttft_text((0, 0, 500, 500), tokens=1000))})
    history.add(5.0, {"a": parse_scrape(ttft_text((10, 10, 10, 10), tokens=50))})  # restarted
    summary = history.summary()
    assert summary["tokens_per_s"] == pytest.approx(10.0)  # 50 since the restart, over 5 s
    assert summary["latency"]["ttft_s"]["count"] == 10
    history.add(20.0, {"a": parse_scrape(ttft_text((20, 20, 20, 20), tokens=50))})
    assert history.summary()["latency"]["window_s"] == 0  # the others are over 10 s old
    history.add(25.0, {"a": parse_scrape(ttft_text((20, 20, 20, 20), tokens=50))})
    quiet = history.summary()["latency"]  # no first token in the window: since start
    assert quiet["window_s"] == 5.0 and quiet["ttft_s"]["since_start"]
    assert quiet["ttft_s"]["count"] == 20


def test_a_source_missing_from_the_older_poll_adds_nothing_to_rates_or_windows() -> None:
    history = ScrapeHistory()
    history.add(0.0, {"a": parse_scrape(ttft_text((0, 0, 0, 0), tokens=100))})
    both = {"a": parse_scrape(ttft_text((4, 4, 4, 4), tokens=300)),
            "peer": parse_scrape(ttft_text((0, 0, 900, 900), tokens=10_000))}  # fmt: skip
    history.add(2.0, both)
    summary = history.summary()
    assert summary["tokens_per_s"] == pytest.approx(100.0)
    assert summary["latency"]["ttft_s"]["count"] == 4
    assert summary["generated_tokens"] == 10_300


def test_a_real_registry_with_the_contract_names_is_read() -> None:
    registry = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", ["model_name"],
                     buckets=(0.1, 0.5, 1.0), registry=registry)  # fmt: skip
    tokens = Counter("vllm:generation_tokens", "tokens", ["model_name"], registry=registry)
    lag = Gauge("sluice_consumer_lag_records", "lag", ["group", "topic"], registry=registry)
    for _ in range(3):
        ttft.labels("m").observe(0.05)
    ttft.labels("m").observe(0.7)
    tokens.labels("m").inc(42)
    lag.labels("engine.m", request_topic(Lane.BATCH, "m")).set(9)
    scrapes, sources = _run(scrape_all([], registry=registry))
    history = ScrapeHistory()
    history.add(0.0, scrapes)
    summary = history.summary()
    assert [s.as_dict() for s in sources] == [{"name": "self", "ok": True, "error": None}]
    assert summary["queue_depth"]["batch"] == 9.0
    assert summary["generated_tokens"] == 42.0
    assert summary["latency"]["ttft_s"]["p50"] == pytest.approx(0.1 * 2 / 3)


def _run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


# -- the ledger queries ----------------------------------------------------------------
@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    PriceBook(database).set("llama-small", input_usd="1", cached_input_usd="0.5", output_usd="2")
    PriceBook(database).set("llama-large", input_usd="3", cached_input_usd="1", output_usd="9")
    yield database
    database.close()


def test_tenants_today_match_the_usage_report_for_that_day(db: Database) -> None:
    UsageLedger(db).record(make_usages(60, tenants=("ten_a", "ten_b", "ten_c")))
    day = dt.datetime.fromtimestamp(START_MS / 1000, dt.UTC).date()
    rows = tenant_usage_on(db, day)
    assert {r.tenant_id for r in rows} == {"ten_a", "ten_b", "ten_c"}
    for row in rows:
        report = usage_report(db, tenant_id=row.tenant_id, since=day, until=day)
        assert row.totals == report.totals
        assert row.as_dict()["total_tokens"] == (
            report.totals.prompt_tokens + report.totals.completion_tokens
        )
    spend = [r.totals.cost_picos for r in rows]
    assert spend == sorted(spend, reverse=True)
    assert tenant_usage_on(db, day + dt.timedelta(days=30)) == []


# -- the routes ------------------------------------------------------------------------
@pytest.fixture
def app(memory_bus: MemoryEventBus) -> FastAPI:
    settings = gateway_settings(admin_key=ADMIN)
    return create_app(settings, memory_bus, [served_model("tiny", max_model_len=256)])


def peer_transport(text: str) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if str(request.url) == PEER:
            return httpx.Response(200, text=text)
        raise httpx.ConnectError("connection refused", request=request)

    return httpx.MockTransport(handler)


def admin(client: TestClient, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {"Authorization": ""}
    return client.get("/dashboard/data", headers=headers)


def test_the_shell_is_html_without_data_or_key(app: FastAPI) -> None:
    with TestClient(app) as client:
        r = client.get("/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "/dashboard/data" in r.text and "sessionStorage" in r.text
    assert "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")  # no CDN
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "/dashboard" not in app.openapi()["paths"]


def test_data_needs_the_admin_key(app: FastAPI) -> None:
    with TestClient(app) as client:
        for key in (None, "sk-wrong"):
            r = admin(client, key)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        assert admin(client).status_code == 200


def test_data_is_403_when_no_admin_key_is_configured(memory_bus: MemoryEventBus) -> None:
    app = create_app(gateway_settings(), memory_bus, [served_model()])
    with TestClient(app) as client:
        r = admin(client, "anything")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_data_aggregates_peers_and_reports_a_dead_one(app: FastAPI) -> None:
    dead = "http://dead.test/metrics"
    # a registry of its own for "self": the process's is shared with earlier tests
    app.state.dashboard = DashboardState([PEER, dead], peer_transport(ttft_text((50, 90, 100, 100),
                                         lag=2)), registry=CollectorRegistry())  # fmt: skip
    with TestClient(app) as client:
        r = admin(client)
    assert r.status_code == 200, r.text
    body = r.json()
    by_name = {s["name"]: s for s in body["sources"]}
    assert by_name["self"]["ok"] and by_name[PEER]["ok"]
    assert not by_name[dead]["ok"] and "ConnectError" in by_name[dead]["error"]
    assert body["queue_depth"] == {"interactive": 3.0, "standard": 7.0, "batch": None}
    assert body["requests"]["running"] >= 3.0
    assert body["latency"]["ttft_s"]["p50"] == pytest.approx(0.1)
    assert body["tenants"] == {"available": False, "day": body["tenants"]["day"], "data": []}
    assert body["batches"] == {"available": False, "data": []}


def test_data_lists_tenants_today_and_batches_in_progress(
    app: FastAPI, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    today_ms = int(dt.datetime.now(dt.UTC).replace(hour=0, minute=0).timestamp() * 1000)
    usages = [
        u.model_copy(update={"timings": u.timings.model_copy(update={"finished_ms": today_ms})})
        for u in make_usages(10, tenants=("ten_today",))
    ]
    UsageLedger(db).record(usages)
    store = BatchStore(db)
    batch = store.create_batch(tenant_id="ten_today", key_id=None, input_file_id="file-1",
                               endpoint="/v1/chat/completions", completion_window="24h",
                               window_s=86_400, metadata=None)  # fmt: skip
    monkeypatch.setattr(admin_routes, "tenancy_db", lambda gw: db)  # the key check stays real

    class Batches:
        pass

    control = Batches()
    control.store = store  # type: ignore[attr-defined]
    app.state.batches = control
    with TestClient(app) as client:
        assert admin(client, "sk-wrong").status_code == 401
        body = admin(client).json()
    [row] = body["tenants"]["data"]
    assert row["tenant_id"] == "ten_today" and row["requests"] == 10
    assert row["total_tokens"] == sum(u.prompt_tokens + u.completion_tokens for u in usages)
    assert row["cost_usd"] != "0.00"
    assert [b["id"] for b in body["batches"]["data"]] == [batch.id]


# -- Grafana ---------------------------------------------------------------------------
def test_the_grafana_dashboard_loads_and_every_panel_queries_a_datasource() -> None:
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/sluice.json").read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 6
    exprs = []
    for panel in panels:
        assert panel["datasource"]["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            query = target.get("expr") or target.get("rawSql") or ""
            assert query.strip(), panel["title"]
            exprs.append(query)
    text = "\n".join(exprs)
    for needle in ("histogram_quantile", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket",
                   "rate(vllm:generation_tokens_total[1m])", "sluice_consumer_lag_records",
                   "vllm:kv_cache_usage_perc", 'decision="rejected"', "usage_ledger"):  # fmt: skip
        assert needle in text, needle
    provisioning = REPO / "deploy/grafana/provisioning"
    sources = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    types = {s["uid"]: s["type"] for s in sources["datasources"]}
    assert {
        p["datasource"]["uid"]: p["datasource"]["type"] for p in panels
    }.items() <= types.items()
    assert set(types.values()) == {"prometheus", "postgres"}
    provider = (REPO / "deploy/grafana/provisioning/dashboards/sluice.yml").read_text()
    assert "path: /var/lib/grafana/dashboards/sluice" in provider


def test_the_contract_metrics_of_this_process_reach_the_data(app: FastAPI) -> None:
    from sluice.tracing import metrics

    topic = request_topic(Lane.BATCH, "tiny")
    with TestClient(app) as client:
        before = admin(client).json()
        metrics.GENERATION_TOKENS.labels("dash-test").inc(40)
        metrics.CONSUMER_LAG.labels("dash-test-group", topic).set(5)
        for _ in range(4):
            metrics.TIME_TO_FIRST_TOKEN.labels("dash-test").observe(0.02)
        try:
            after = admin(client).json()
        finally:
            metrics.CONSUMER_LAG.remove("dash-test-group", topic)
    assert after["generated_tokens"] - (before["generated_tokens"] or 0) == 40
    assert after["queue_depth"]["batch"] - (before["queue_depth"]["batch"] or 0) == 5
    ttft = after["latency"]["ttft_s"]
    assert ttft["count"] == 4 and not ttft["since_start"]  # the two polls' difference
    assert 0 < ttft["p50"] <= ttft["p99"] <= 0.1


def test_a_failing_collector_or_garbage_from_a_peer_is_reported_not_raised() -> None:
    class Broken:
        def collect(self) -> Any:
            raise RuntimeError("engine gone")

    registry = CollectorRegistry()
    registry.register(Broken())  # type: ignore[arg-type]
    scrapes, sources = _run(
        scrape_all([PEER], registry=registry, transport=peer_transport("not { prometheus"))
    )
    assert scrapes == {}
    assert [(s.name, s.ok) for s in sources] == [("self", False), (PEER, False)]
    assert "engine gone" in (sources[0].error or "")
    assert (sources[1].error or "").startswith("unreadable metrics")


def test_the_grafana_queries_parse_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        service_missing("promtool (Debian's prometheus package) is not installed")
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/sluice.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    # promtool knows no Grafana variables: $__rate_interval stands for a range
    rules = [{"record": f"sluice:check{i}", "expr": e.replace("$__rate_interval", "5m")}
             for i, e in enumerate(exprs)]  # fmt: skip
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                             text=True, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
