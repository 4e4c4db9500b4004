"""SLO admission's predictor and decision, on given worker loads and a fake clock."""

from __future__ import annotations

import pytest

from sluice.api.errors import ServerOverloaded
from sluice.api.slo import SloAdmission, SloPools
from sluice.bus.messages import GenerateRequest, Heartbeat, TokenDelta, WorkerLoad
from sluice.bus.topics import Lane
from sluice.tracing import metrics

TARGETS = {"interactive": 2.0, "standard": 10.0}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(
    worker: str,
    tokens: dict[str, int],
    rate: float | None = 1000.0,
    interval_ms: int = 1000,
    first_release_s: float = 0.0,
    pool: str | None = None,
) -> Heartbeat:
    load = WorkerLoad(
        queued_tokens=tokens, prefill_tokens_per_s=rate, first_release_s=first_release_s
    )
    return Heartbeat(sender_id=worker, role="worker", interval_ms=interval_ms, load=load, pool=pool)


def request(request_id: str, lane: Lane, prompt_tokens: int, model: str = "m") -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        tenant_id="t1",
        model=model,
        lane=lane,
        prompt_token_ids=[1] * prompt_tokens,
        reply_to="gw",
        created_ms=0,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def slo(clock: Clock) -> SloAdmission:
    return SloAdmission(TARGETS, clock=clock)


def test_ttft_is_the_tokens_ahead_in_this_and_higher_lanes_over_the_summed_rates(
    slo: SloAdmission,
) -> None:
    slo.heard(beat("w1", {"interactive": 500, "standard": 3000, "batch": 90_000}, rate=1000.0))
    slo.heard(beat("w2", {"interactive": 500, "standard": 1000}, rate=1000.0))
    # 2,000 tokens/s in all; batch work never counts ahead of interactive or standard
    assert slo.predict("interactive", 1000) == pytest.approx((1000 + 1000) / 2000)
    assert slo.predict("standard", 1000) == pytest.approx((1000 + 4000 + 1000) / 2000)
    assert slo.predict("batch", 0) == pytest.approx(95_000 / 2000)


def test_while_tokens_wait_ahead_a_slot_frees_first_when_a_running_request_ends(
    slo: SloAdmission,
) -> None:
    slo.heard(beat("w1", {"standard": 1000}, rate=1000.0, first_release_s=0.5))
    slo.heard(beat("w2", {}, rate=1000.0, first_release_s=0.3))
    # the mean of the workers' first releases, then the releases at the summed rate
    assert slo.predict("standard", 1000) == pytest.approx(0.4 + 2000 / 2000)
    assert slo.predict("interactive", 1000) == pytest.approx(1000 / 2000)  # none ahead


def test_what_this_gateway_published_since_the_heartbeat_counts_until_its_first_token(
    slo: SloAdmission,
) -> None:
    slo.heard(beat("w1", {"interactive": 1000}))
    burst = [request(f"r{i}", Lane.INTERACTIVE, 500) for i in range(6)]
    slo.published(burst)
    # the gateway's own 3,000 unstarted tokens exceed the heartbeat's 1,000: the larger wins
    assert slo.predict("interactive", 0) == pytest.approx(3.0)
    slo.on_delta(TokenDelta(request_id="r0", seq_no=0, token_ids=[7]))
    slo.on_delta(TokenDelta(request_id="r1", seq_no=0, finish_reason="abort"))
    slo.forget("r2")
    assert slo.predict("interactive", 0) == pytest.approx(1.5)


def test_a_call_that_would_miss_its_target_is_refused_with_the_drain_time_to_retry(
    slo: SloAdmission,
) -> None:
    slo.heard(beat("w1", {"interactive": 1500}, rate=1000.0))
    slo.check([request("ok", Lane.INTERACTIVE, 500)])  # 2.0 s: on target
    with pytest.raises(ServerOverloaded) as refused:
        slo.check([request("a", Lane.INTERACTIVE, 1000), request("b", Lane.INTERACTIVE, 1000)])
    assert refused.value.status_code == 429 and refused.value.code == "server_overloaded"
    # predicted 3.5 s against a 2 s target: the backlog needs 1.5 s more to drain
    assert refused.value.headers["retry-after"] == "2"


def test_the_batch_lane_is_never_refused(slo: SloAdmission) -> None:
    slo.heard(beat("w1", {"batch": 10_000_000}, rate=10.0))
    slo.check([request("b", Lane.BATCH, 4000)])


def test_nothing_is_refused_without_a_measured_rate_or_a_fresh_worker(
    slo: SloAdmission, clock: Clock
) -> None:
    big = [request("r", Lane.INTERACTIVE, 100_000)]
    slo.check(big)  # no heartbeat yet
    slo.heard(beat("w1", {"interactive": 100_000}, rate=None))
    slo.check(big)  # a cold worker: no rate measured
    slo.heard(beat("w1", {"interactive": 100_000}, rate=100.0))
    with pytest.raises(ServerOverloaded):
        slo.check(big)
    clock.now += 3.5  # three intervals without a heartbeat: the engine-down paths answer
    slo.check(big)


def test_a_worker_that_stopped_beating_leaves_the_fleet(slo: SloAdmission, clock: Clock) -> None:
    slo.heard(beat("w1", {"interactive": 4000}, rate=1000.0))
    clock.now += 5.0
    slo.heard(beat("w2", {"interactive": 0}, rate=1000.0))
    assert slo.predict("interactive", 1000) == pytest.approx(1.0)


def test_the_prediction_error_is_observed_at_the_first_token(
    slo: SloAdmission, clock: Clock
) -> None:
    def count() -> float:
        value = metrics.REGISTRY.get_sample_value(
            "sluice_ttft_prediction_error_seconds_count", {"lane": "standard"}
        )
        return value or 0.0

    slo.heard(beat("w1", {}, rate=1000.0))
    slo.published([request("r", Lane.STANDARD, 2000)])  # predicted 2.0 s
    before = count()
    clock.now += 2.5
    slo.on_delta(TokenDelta(request_id="r", seq_no=0, token_ids=[1]))
    assert count() == before + 1
    le = metrics.REGISTRY.get_sample_value(
        "sluice_ttft_prediction_error_seconds_bucket", {"lane": "standard", "le": "0.5"}
    )
    below = metrics.REGISTRY.get_sample_value(
        "sluice_ttft_prediction_error_seconds_bucket", {"lane": "standard", "le": "0.25"}
    )
    assert le is not None and below is not None and le - below >= 1  # 0.5 s late


def test_first_tokens_later_than_predicted_raise_the_lanes_margin_and_earlier_ones_lower_it(
    slo: SloAdmission, clock: Clock
) -> None:
    slo.heard(beat("w1", {}, rate=1000.0))
    for i in range(40):  # each first token 1 s later than its 0.5 s prediction
        slo.published([request(f"late{i}", Lane.INTERACTIVE, 500)])
        clock.now += 1.5
        slo.heard(beat("w1", {}, rate=1000.0))
        slo.on_delta(TokenDelta(request_id=f"late{i}", seq_no=0, token_ids=[1]))
    margin = slo.margin_s("interactive")
    assert 0.9 < margin <= 1.0 + 0.05 * 0.99
    assert slo.margin_s("standard") == 0.0
    # 1,600 tokens: 1.6 s predicted, within the 2 s target but not with the margin
    with pytest.raises(ServerOverloaded):
        slo.check([request("r", Lane.INTERACTIVE, 1600)])
    for i in range(2500):  # on time again: the margin comes down to nothing
        slo.published([request(f"ok{i}", Lane.INTERACTIVE, 500)])
        slo.on_delta(TokenDelta(request_id=f"ok{i}", seq_no=0, token_ids=[1]))
    assert slo.margin_s("interactive") == 0.0
    slo.check([request("r", Lane.INTERACTIVE, 1600)])


def test_a_burst_onto_an_idle_fleet_waits_for_this_gateways_own_running_requests(
    slo: SloAdmission, clock: Clock
) -> None:
    slo.heard(beat("w1", {}, rate=1000.0))  # the last heartbeat saw an idle engine
    slo.published([request("old", Lane.STANDARD, 100)])
    slo.on_delta(TokenDelta(request_id="old", seq_no=0, token_ids=[1]))
    clock.now += 2.0
    slo.on_delta(TokenDelta(request_id="old", seq_no=1, token_ids=[1], finish_reason="length"))
    # decoding takes 2 s; two requests start now and a third waits behind them
    burst = [request(f"r{i}", Lane.STANDARD, 1000) for i in range(3)]
    slo.published(burst)
    for r in burst[:2]:
        slo.on_delta(TokenDelta(request_id=r.request_id, seq_no=0, token_ids=[1]))
    clock.now += 0.5
    # 1,000 tokens ahead: a slot frees in 1.5 s, then 2,000 tokens at 1,000 tokens/s
    assert slo.predict("standard", 1000) == pytest.approx(1.5 + 2.0)


def test_each_pool_is_predicted_from_its_own_workers_beats_alone(clock: Clock) -> None:
    pools = SloPools(TARGETS, ["busy", "idle"], clock=clock)
    pools.heard(beat("w1", {"interactive": 100_000}, rate=1000.0, pool="busy"))
    pools.heard(beat("w2", {}, rate=1000.0, pool="idle"))
    pools.heard(beat("w3", {"interactive": 100_000}, rate=1000.0, pool=None))  # no pool: none
    pools.check([request("fine", Lane.INTERACTIVE, 500, model="idle")])
    with pytest.raises(ServerOverloaded):
        pools.check([request("late", Lane.INTERACTIVE, 500, model="busy")])
    pools.check([request("unknown", Lane.INTERACTIVE, 500, model="not-served")])  # no pool
    assert pools.pools["idle"].predict("interactive", 0) == pytest.approx(0.0)


def test_a_pools_published_requests_count_ahead_in_that_pool_only(clock: Clock) -> None:
    pools = SloPools(TARGETS, ["a", "b"], clock=clock)
    pools.heard(beat("wa", {}, rate=1000.0, pool="a"))
    pools.heard(beat("wb", {}, rate=1000.0, pool="b"))
    pools.published([request(f"r{i}", Lane.INTERACTIVE, 1000, model="a") for i in range(3)])
    assert pools.pools["a"].predict("interactive", 0) > 0
    assert pools.pools["b"].predict("interactive", 0) == pytest.approx(0.0)
    for i in range(3):
        pools.forget(f"r{i}")
    assert pools.pools["a"].predict("interactive", 0) == pytest.approx(0.0)
