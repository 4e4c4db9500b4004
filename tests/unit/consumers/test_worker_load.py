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
    in_engine: bool = True


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


def test_the_rate_counts_only_windows_with_a_backlog_at_both_ends() -> None:
    clock = Clock()
    meter = LoadMeter(window_s=1.0, decay=0.5, clock=clock)
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
    # (4000 * 0.5 + 1000) / (1 * 0.5 + 1)
    assert meter.sample(waiting, 1).prefill_tokens_per_s == pytest.approx(2000)
    clock.now += 1.0
    meter.prefilled(100)  # no backlog at the end: not counted
    assert meter.sample([], 1).prefill_tokens_per_s == pytest.approx(2000)


def test_windows_without_a_first_token_count_their_time() -> None:
    clock = Clock()
    meter = LoadMeter(window_s=1.0, decay=1.0, clock=clock)
    waiting = [Item("standard", 1000)]
    clock.now += 1.0
    meter.sample(waiting, 2)  # a window closes with a backlog waiting
    for tokens in (2000, 0, 0, 0, 2000, 0, 0, 0):  # first tokens come in bunches
        clock.now += 0.5
        meter.prefilled(tokens)
        load = meter.sample(waiting, 2)
    assert load.prefill_tokens_per_s == pytest.approx(1000)


def test_the_first_release_is_when_the_running_request_nearest_its_end_should_end() -> None:
    meter = LoadMeter(clock=Clock())
    running = [Item("standard", 10, first_token_ms=9_000), Item("standard", 10, 9_600)]
    assert meter.sample(running, 2, now_ms=10_000).first_release_s == 0.0  # no decode seen
    meter.finished(2.0)
    # decoding for 1.0 s and 0.4 s of a 2 s mean: the first should end in 1 s
    assert meter.sample(running, 2, now_ms=10_000).first_release_s == pytest.approx(1.0)
    meter.finished(4.0)  # EWMA: 2.0 + 0.3 * 2.0
    assert meter.sample(running, 2, now_ms=10_000).first_release_s == pytest.approx(1.6)
