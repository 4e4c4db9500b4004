"""SLUICE_METRICS_ENABLED: with `tracing.metrics.set_enabled(False)` no helper counts.

Each case drives every observe/count helper as N requests would (admission, publish,
engine steps, finished attempts, billing, dead letters, lag, batches), reads the registry
before and after, then switches metrics on again and checks the same calls count. Labels
only this file uses (model, topic, group) keep other tests' counts out of the deltas.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.bus.base import TopicPartition
from sluice.bus.messages import Timings, UsageRecord
from sluice.bus.topics import Lane
from sluice.cli_serving import switch_metrics
from sluice.settings import Settings
from sluice.tracing import metrics

MODEL = "switch-model"
TOPIC = "switch.topic"
GROUP = "switch-group"
N = 20


@pytest.fixture(autouse=True)
def _metrics_on_after() -> Iterator[None]:
    yield
    metrics.set_enabled(True)  # the process-wide default, for every other test


def totals() -> dict[str, float]:
    """The samples this file's labels touch, summed per sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            ours = (
                s.labels.get("model_name") == MODEL
                or s.labels.get("topic") == TOPIC
                or s.labels.get("group") == GROUP
                or s.labels.get("reason") == "switch-test"
                or s.name.startswith(("sluice_tokens_billed", "sluice_batch_lines"))
            )
            if ours and not s.name.endswith("_created"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def usage(i: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"switch-{i}",
        tenant_id="t-switch",
        model=MODEL,
        lane=Lane.STANDARD,
        prompt_tokens=7,
        completion_tokens=4,
        cached_tokens=2,
        finish_reason="length",
        timings=Timings(
            queued_ms=1_000, scheduled_ms=1_010, first_token_ms=1_020, finished_ms=1_050
        ),
    )


def requests_worth(n: int) -> None:
    """What n requests make the helpers do, from the gateway to billing."""
    timer = metrics.StepTimer()
    billing = metrics.BillingLag()
    lag = metrics.LagReporter(GROUP, [TOPIC], interval_s=0.0)
    for i in range(n):
        metrics.count_admission("admitted", "switch-test")
        published: Future[None] = Future()
        metrics.time_publish(published, TOPIC)
        published.set_result(None)
        rid = f"switch-{i}"
        for k in range(4):
            timer.step([(rid, MODEL, 1, k == 3)])
        metrics.observe_attempt(usage(i))
        billing.billed(usage(i), new=True)
        metrics.count_dead_letter(TOPIC)
        lag.refresh(lambda: {TopicPartition(TOPIC, 0): 5})
    metrics.count_batch_lines(n, 1)


def test_switched_off_no_counter_moves_and_on_again_they_count() -> None:
    metrics.set_enabled(False)
    assert not metrics.metrics_enabled()
    before = totals()
    requests_worth(N)
    assert totals() == before

    metrics.set_enabled(True)
    requests_worth(N)
    after = totals()
    grew = {name for name, value in after.items() if value != before.get(name, 0.0)}

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:request_success_total") == N
    assert delta("vllm:generation_tokens_total") == 4 * N
    assert delta("vllm:time_to_first_token_seconds_count") == N
    assert delta("sluice_admission_decisions_total") == N
    assert delta("sluice_bus_publish_seconds_count") == N
    assert delta("sluice_dead_letters_total") == N
    assert after["sluice_consumer_lag_records"] == 5
    assert {
        "vllm:prompt_tokens_total",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "sluice_tokens_billed_total",
        "sluice_batch_lines_total",
    } <= grew


def test_off_lag_reporter_is_never_due() -> None:
    """The engine worker reads the consumer's lag only when `due()`: off, never."""
    lag = metrics.LagReporter(GROUP, [TOPIC], interval_s=0.0)
    metrics.set_enabled(False)
    assert not lag.due()
    metrics.set_enabled(True)
    assert lag.due()


def test_off_metrics_route_still_answers() -> None:
    from fastapi import FastAPI

    from sluice.api.routes.metrics import router

    app = FastAPI()
    app.include_router(router)
    metrics.set_enabled(False)
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert "vllm:time_to_first_token_seconds" in response.text


def test_setting_applies_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_METRICS_ENABLED", "false")
    switch_metrics(Settings())
    assert not metrics.metrics_enabled()
    monkeypatch.setenv("SLUICE_METRICS_ENABLED", "true")
    switch_metrics(Settings())
    assert metrics.metrics_enabled()
