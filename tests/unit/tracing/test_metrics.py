"""The Prometheus metrics: exact counts after known requests, and `/metrics` parses.

The registry is process-global (other tests count into it too), so every check reads a
delta (after - before), or a label only this test uses.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.api.app import create_app
from sluice.billing import admin
from sluice.bus.base import TopicPartition, TopicSpec
from sluice.bus.errors import DecodeError
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import Message, Timings, UsageRecord
from sluice.bus.topics import Lane, TopicLayout, pool_id
from sluice.consumers.engine_worker import EngineWorkerConfig
from sluice.consumers.loop import ConsumeLoop, LoopConfig
from sluice.storage.db import Database, embedded_url
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.tracing import metrics
from sluice.up import GATEWAY, Child, assign_metrics_ports
from tests.integration.billing.gateway_stack import MODEL, start_stack
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, served_model
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request
from tests.unit.consumers.sim_engine import RecordingSimBackend

Labels = dict[str, str]


def sample(name: str, labels: Labels | None = None, text: str | None = None) -> float:
    """The value of one sample (summed over label sets matching `labels`); 0 if absent."""
    text = text if text is not None else generate_latest(REGISTRY).decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def test_metrics_route_serves_prometheus_text_outside_the_schema() -> None:
    bus = MemoryEventBus()
    bus.create_topics(
        TopicLayout(request_partitions=2, tokens_partitions=1, pools=("tiny",)).specs()
    )
    engine = FakeEngineWorker(bus).start()
    try:
        app = create_app(gateway_settings(), bus, [served_model("tiny")])
        with TestClient(app) as client:  # no key: /metrics is open, as vLLM's is
            before = sample("sluice_bus_publish_seconds_count")
            for _ in range(3):
                r = client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
                assert r.status_code == 200, r.text
            response = client.get("/metrics")
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain")
            families = {f.name for f in text_string_to_metric_families(response.text)}
            assert {
                "vllm:time_to_first_token_seconds",
                "vllm:prompt_tokens",
                "sluice_consumer_lag_records",
                "sluice_bus_publish_seconds",
            } <= families
            # the publish is confirmed before the response: every one was observed
            assert sample("sluice_bus_publish_seconds_count", text=response.text) - before == 3
            assert "/metrics" not in client.get("/openapi.json").json()["paths"]
    finally:
        engine.stop()
        bus.close()


def test_engine_worker_counts_equal_the_requests() -> None:
    """N requests of known sizes: token counters, finish reasons, one TTFT/e2e/queue
    observation each and one ITL observation per later token; the gauges are live."""
    model = f"m-{uuid.uuid4().hex[:8]}"  # a label no other test touches
    bus = MemoryEventBus()
    create_topics(bus, pools=(pool_id(model),))
    backend = RecordingSimBackend(step_s=0.002)
    config = EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01)
    worker = WorkerThread(bus, backend, config, pool=pool_id(model))
    worker.worker.model_name = model
    worker.start()
    client = Client(bus)
    try:
        sizes = [(3, 4), (5, 1), (7, 6), (2, 9)]  # (prompt tokens, max_tokens)
        requests = [
            make_request(f"r{i}", prompt=list(range(1, p + 1)), max_tokens=m).model_copy(
                update={"model": model}
            )
            for i, (p, m) in enumerate(sizes)
        ]
        client.send(*requests)
        client.wait_finished([r.request_id for r in requests])
        text = generate_latest(REGISTRY).decode()
        by_model = {"model_name": model}
        assert sample("vllm:prompt_tokens_total", by_model, text) == sum(p for p, _ in sizes)
        assert sample("vllm:generation_tokens_total", by_model, text) == sum(m for _, m in sizes)
        assert sample("vllm:prefix_cache_queries_total", by_model, text) == sum(p for p, _ in sizes)
        assert sample("vllm:prefix_cache_hits_total", by_model, text) == 0
        success = {**by_model, "finished_reason": "length"}
        assert sample("vllm:request_success_total", success, text) == len(sizes)
        for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
            assert sample(f"vllm:{histogram}_seconds_count", by_model, text) == len(sizes)
        itl = sample("vllm:inter_token_latency_seconds_count", by_model, text)
        assert itl == sum(m - 1 for _, m in sizes)
        assert sample("vllm:inter_token_latency_seconds_sum", by_model, text) > 0
        names = {
            s.name: s.labels
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("model_name") == model
        }
        assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= set(names)
    finally:
        client.close()
        worker.stop()
        bus.close()
    # a stopped worker's engine leaves the gauges
    assert sample("vllm:num_requests_running", {"model_name": model}) == 0


def test_consume_loop_reports_lag_and_dead_letters() -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    bus = MemoryEventBus()
    bus.create_topics([TopicSpec(topic, 1), TopicSpec(f"{topic}.dlq", 1)])
    for i in range(5):
        bus.publish(topic, f"not json {i}".encode()).result(5)

    def undecodable(record: object) -> Message:
        raise DecodeError("bad")

    class Never:
        def handle(self, message: Message, record: object) -> None:
            raise AssertionError("nothing decodes")

    loop = ConsumeLoop(
        bus, group, [topic], Never(), config=LoopConfig(max_records=2), decoder=undecodable
    )
    loop._consumer = bus.consumer(group, [topic])
    try:
        assert loop.run_once() == 2
        # read after the first poll: 3 of 5 records were not yet consumed
        assert sample("sluice_consumer_lag_records", {"group": group, "topic": topic}) == 3
        while loop.run_once():
            pass
        assert sample("sluice_dead_letters_total", {"topic": topic}) == 5
    finally:
        loop._consumer.close()
        bus.close()


def test_memory_consumer_lag_is_end_minus_position() -> None:
    bus = MemoryEventBus()
    bus.create_topics([TopicSpec("lagged", 2)])
    for i in range(6):
        bus.publish("lagged", b"x", partition=i % 2).result(5)
    consumer = bus.consumer("lag-test", ["lagged"])
    try:
        assert len(consumer.poll(1.0, max_records=2)) == 2
        lag = consumer.lag()
        assert sum(lag.values()) == 4
        assert set(lag) == {TopicPartition("lagged", 0), TopicPartition("lagged", 1)}
    finally:
        consumer.close()
        bus.close()


def test_step_timer_spreads_a_step_over_its_tokens() -> None:
    model = f"m-{uuid.uuid4().hex[:8]}"
    now = [100.0]
    timer = metrics.StepTimer(clock=lambda: now[0])
    timer.step([("a", model, 1, False)])  # the first token: no gap yet
    now[0] += 0.3
    timer.step([("a", model, 3, False)])  # three tokens in one step: three gaps
    timer.step([("a", model, 0, True)])
    labels = {"model_name": model}
    assert sample("vllm:inter_token_latency_seconds_count", labels) == 3
    assert sample("vllm:generation_tokens_total", labels) == 4
    total = sample("vllm:inter_token_latency_seconds_sum", labels)
    assert total == pytest.approx(0.3)  # the one interval, split three ways, sums back to it
    assert timer._last == {}


def test_billing_lag_is_nan_until_a_record_then_now_minus_its_finish() -> None:
    now_s = 1_700_000_000.0
    lag = metrics.BillingLag(clock=lambda: now_s)
    assert math.isnan(lag.seconds())
    finished_ms = int(now_s * 1000) - 5000
    usage = UsageRecord(
        request_id="r",
        tenant_id="t",
        model="m",
        lane=Lane.BATCH,
        prompt_tokens=3,
        completion_tokens=4,
        finish_reason="stop",
        timings=Timings(queued_ms=finished_ms - 10, finished_ms=finished_ms),
    )
    before = sample("sluice_tokens_billed_total", {"lane": "batch"})
    lag.billed(usage, new=True)
    lag.billed(usage, new=False)  # a redelivery bills nothing
    assert lag.seconds() == 5.0
    assert sample("sluice_tokens_billed_total", {"lane": "batch"}) - before == 7


def test_sluice_up_gives_every_child_a_port_and_writes_file_sd_targets(tmp_path: Path) -> None:
    children = [
        Child("gateway", ["sluice", "gateway"], stage=GATEWAY),
        Child("engine-worker-0", ["sluice", "worker", "engine"]),
        Child("billing", ["sluice", "worker", "billing"]),
    ]
    targets = tmp_path / "data" / "metrics-targets.json"
    assign_metrics_ports(children, "127.0.0.1:8000", targets)
    entries = json.loads(targets.read_text())
    assert [e["labels"] for e in entries] == [
        {"job": "sluice", "process": "gateway"},
        {"job": "sluice", "process": "engine-worker-0"},
        {"job": "sluice", "process": "billing"},
    ]
    assert entries[0]["targets"] == ["127.0.0.1:8000"]
    ports = [c.env["SLUICE_METRICS_PORT"] for c in children[1:]]
    assert [e["targets"] for e in entries[1:]] == [[f"127.0.0.1:{p}"] for p in ports]
    assert "SLUICE_METRICS_PORT" not in children[0].env
    assert children[0].env["SLUICE_METRICS_PEERS"] == ",".join(
        f"http://127.0.0.1:{p}/metrics" for p in ports
    )


def test_start_metrics_server_serves_this_process() -> None:
    from tests.unit.api.fakes import free_port

    port = free_port()
    assert metrics.start_metrics_server(port)
    metrics.TIME_TO_FIRST_TOKEN.labels("served").observe(0.1)
    # as Prometheus asks: the text format all the same, its vLLM names intact
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    assert response.headers["content-type"].startswith("text/plain")
    assert sample("vllm:time_to_first_token_seconds_count", {"model_name": "served"}, response.text)
    assert not metrics.start_metrics_server(None)


def test_the_metrics_port_answers_probes_as_set() -> None:
    from tests.unit.api.fakes import free_port

    port = free_port()
    assert metrics.start_metrics_server(port)
    base = f"http://127.0.0.1:{port}"
    ready = {"now": False}
    try:
        # before set_probes: the process is up
        assert httpx.get(f"{base}/readyz").status_code == 200
        metrics.set_probes(healthy=lambda: True, ready=lambda: ready["now"])
        assert httpx.get(f"{base}/readyz").status_code == 503
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
        ready["now"] = True
        assert httpx.get(f"{base}/readyz").status_code == 200

        def broken() -> bool:
            raise RuntimeError("cannot tell")

        metrics.set_probes(healthy=broken, ready=broken)
        assert httpx.get(f"{base}/healthz").status_code == 503
    finally:
        metrics.set_probes(healthy=lambda: True, ready=lambda: True)


def test_an_engine_worker_is_not_ready_before_its_probes_are_set() -> None:
    """`sluice worker engine` serves metrics before its worker exists: /readyz says 503
    until the worker's probe takes over (a rolling restart waits on it)."""
    from sluice.cli_serving import serve_metrics
    from sluice.settings import EngineWorkerSettings
    from tests.unit.api.fakes import free_port

    port = free_port()
    try:
        serve_metrics(EngineWorkerSettings(metrics_port=port), ready_later=True)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 503
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        metrics.set_probes(healthy=lambda: True, ready=lambda: True)


@pytest.fixture
def tenancy_db(tmp_path: Path) -> Iterator[Database]:
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    yield db
    db.close()


def test_admission_billing_and_publish_through_the_whole_flow(tenancy_db: Database) -> None:
    """Gateway with tenant admission → engine worker → billing: admitted and 429'd
    requests by reason, tokens billed, the billing lag and one TTFT per request."""
    admin.set_price(tenancy_db, MODEL, input_usd="1", cached_input_usd="0.5", output_usd="2")
    tenant = admin.create_tenant(tenancy_db, "metered", rpm=3, tpm=1_000_000)
    shared = MemoryQuotaStore()
    stack = start_stack(tenancy_db, lambda: shared)
    try:
        admitted = {"decision": "admitted", "reason": "within_limits"}
        rejected = {"decision": "rejected", "reason": "requests"}
        ttft = {"model_name": MODEL}
        before = {
            "admitted": sample("sluice_admission_decisions_total", admitted),
            "rejected": sample("sluice_admission_decisions_total", rejected),
            "ttft": sample("vllm:time_to_first_token_seconds_count", ttft),
            "tokens": sample("vllm:generation_tokens_total", ttft),
            "billed": sample("sluice_tokens_billed_total"),
        }
        headers = {"Authorization": f"Bearer {tenant['api_key']}"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        with httpx.Client(base_url=stack.urls[0], headers=headers, timeout=30) as http:
            codes = [http.post("/v1/chat/completions", json=body) for _ in range(5)]
            assert [r.status_code for r in codes] == [200, 200, 200, 429, 429]
            usage = [r.json()["usage"] for r in codes[:3]]
            stack.wait(
                lambda: (
                    sample("sluice_tokens_billed_total") - before["billed"]
                    >= sum(u["total_tokens"] for u in usage)
                ),
                what="the ledger",
            )
            text = http.get("/metrics").text
        assert sample("sluice_admission_decisions_total", admitted, text) - before["admitted"] == 3
        assert sample("sluice_admission_decisions_total", rejected, text) - before["rejected"] == 2
        assert sample("vllm:time_to_first_token_seconds_count", ttft, text) - before["ttft"] == 3
        generated = sample("vllm:generation_tokens_total", ttft, text) - before["tokens"]
        assert generated == sum(u["completion_tokens"] for u in usage)
        billed = sample("sluice_tokens_billed_total", text=text) - before["billed"]
        assert billed == sum(u["total_tokens"] for u in usage)
        assert sample("sluice_billing_lag_seconds", text=text) >= 0  # a number, not NaN
    finally:
        stack.close()


def test_a_scrape_never_fails_on_a_dead_engine() -> None:
    def broken() -> metrics.EngineStatsLike:
        raise RuntimeError("engine gone")

    unwatch = metrics.watch_engine("broken-model", broken)
    try:
        assert "vllm:num_requests_running" in generate_latest(REGISTRY).decode()
    finally:
        unwatch()


def test_batch_gauges_and_lines() -> None:
    before = sample("sluice_batch_lines_total", {"outcome": "failed"})
    metrics.count_batch_lines(completed=2, failed=1)
    assert sample("sluice_batch_lines_total", {"outcome": "failed"}) - before == 1
    metrics.set_batch_counts({"in_progress": 2})
    assert sample("sluice_batches", {"status": "in_progress"}) == 2
    assert sample("sluice_batches", {"status": "validating"}) == 0
    metrics.set_batch_counts({})


@pytest.mark.parametrize("amount", [0.0, 0.004, 0.02, 0.0200001, 7.5, 1e9])
def test_many_observations_at_once_read_as_one_at_a_time(amount: float) -> None:
    from prometheus_client import CollectorRegistry, Histogram

    from sluice.tracing.metrics import _observe_many

    registry = CollectorRegistry()
    buckets = (0.005, 0.01, 0.02, 0.05, 1.0)
    one = Histogram("one_seconds", "", buckets=buckets, registry=registry)
    many = Histogram("many_seconds", "", buckets=buckets, registry=registry)
    for _ in range(7):
        one.observe(amount)
    _observe_many(many, amount, 7)

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        family = next(f for f in registry.collect() if f.name == name)
        return [
            (s.name.replace(name, ""), s.labels, s.value)
            for s in family.samples
            if not s.name.endswith("_created")
        ]

    got, want = samples("many_seconds"), samples("one_seconds")
    assert [s for s in got if s[0] != "_sum"] == [s for s in want if s[0] != "_sum"]
    assert [s[2] for s in got if s[0] == "_sum"] == pytest.approx(
        [s[2] for s in want if s[0] == "_sum"]
    )
