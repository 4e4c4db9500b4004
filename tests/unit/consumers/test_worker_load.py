"""The load an engine worker reports on its heartbeat: backlog per lane, prefill rate."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sluice.consumers.worker_load import LoadMeter


@dataclass
class Item:
    lane: str
    prompt_tokens: int
    first_token_ms: int | None = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_backlog_counts_the_requests_without_a_first_token_per_lane() -> None:
    meter = LoadMeter(clock=Clock())
    items = [Item("interactive", 100), Item("interactive", 50), Item("batch", 7, 123)]
    load = meter.sample(items, num_running=3)
    assert load.queued_tokens == {"interactive": 150}
    assert load.queued_requests == {"interactive": 2}
    assert load.num_running == 3 and load.prefill_tokens_per_s is None


def test_the_rate_is_measured_only_through_a_backlog_or_when_it_beats_the_estimate() -> None:
    clock = Clock()
    meter = LoadMeter(alpha=0.5, clock=clock)
    waiting = [Item("standard", 1000)]
    meter.sample([], 0)
    clock.now += 1.0
    meter.prefilled(200)  # an idle engine's throughput is its offered load
    assert meter.sample(waiting, 1).prefill_tokens_per_s is None
    clock.now += 1.0
    meter.prefilled(4000)  # a backlog at both ends: the engine's capacity
    assert meter.sample(waiting, 1).prefill_tokens_per_s == pytest.approx(4000)
    clock.now += 1.0
    meter.prefilled(1000)  # backlogged, slower (longer decodes share the engine)
    assert meter.sample(waiting, 1).prefill_tokens_per_s == pytest.approx(2500)
    clock.now += 1.0
    meter.prefilled(100)  # not backlogged at the end, and below the estimate: kept
    assert meter.sample([], 1).prefill_tokens_per_s == pytest.approx(2500)
    clock.now += 1.0
    meter.prefilled(4500)  # not backlogged, but faster than estimated: a lower bound
    assert meter.sample([], 1).prefill_tokens_per_s == pytest.approx(3500)
