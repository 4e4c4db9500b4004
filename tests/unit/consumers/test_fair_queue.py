"""The worker's fair queue: lanes by weight (interactive first, batch never starves), DRR."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sluice.consumers.fair_queue import FairQueue, TenantQueues

WEIGHTS = {"interactive": 16, "standard": 4, "batch": 1}


@dataclass(eq=False)
class Item:
    tenant_id: str
    lane: str
    cost: int = 100
    deadline: float | None = None


def test_drr_gives_a_light_tenant_its_share_while_a_heavy_one_is_backlogged() -> None:
    queues: TenantQueues[Item] = TenantQueues(quantum=100)
    for _ in range(100):
        queues.push(Item("heavy", "standard"))
    for _ in range(10):
        queues.push(Item("light", "standard"))
    first = [queues.pop() for _ in range(20)]
    assert sum(1 for i in first if i is not None and i.tenant_id == "light") == 10


def test_drr_shares_tokens_not_requests() -> None:
    queues: TenantQueues[Item] = TenantQueues(quantum=64)
    for _ in range(50):
        queues.push(Item("big", "standard", cost=400))
        queues.push(Item("small", "standard", cost=40))
    tokens = {"big": 0, "small": 0}
    for _ in range(40):
        item = queues.pop()
        assert item is not None
        tokens[item.tenant_id] += item.cost
    assert 0.7 < tokens["small"] / tokens["big"] < 1.3


def test_interactive_goes_before_a_batch_backlog_and_batch_still_gets_its_share() -> None:
    buffer: FairQueue[Item] = FairQueue(WEIGHTS, tenant_quantum=100)
    for _ in range(100):
        buffer.push(Item("t", "batch"))
    assert buffer.pop() is not None  # batch was running alone
    for _ in range(200):
        buffer.push(Item("t", "interactive"))
    lanes = [item.lane for item in (buffer.pop() for _ in range(170)) if item is not None]
    assert lanes[:10] == ["interactive"] * 10
    # 16:1 weights: batch gets ~1/17 of admissions while both are backlogged
    assert 6 <= lanes.count("batch") <= 14

    buffer = FairQueue(WEIGHTS, tenant_quantum=100)
    for _ in range(100):
        buffer.push(Item("t", "standard"))
        buffer.push(Item("t", "batch"))
    lanes = [item.lane for item in (buffer.pop() for _ in range(100)) if item is not None]
    assert 15 <= lanes.count("batch") <= 25  # 4:1


def test_a_lane_arriving_beside_a_busy_one_gets_a_bounded_burst_then_its_share() -> None:
    buffer: FairQueue[Item] = FairQueue(WEIGHTS, tenant_quantum=100)
    for _ in range(50):
        buffer.push(Item("t", "interactive"))
    for _ in range(50):
        buffer.pop()
    for _ in range(200):
        buffer.push(Item("t", "interactive"))
        buffer.push(Item("t", "batch"))
    lanes = [item.lane for item in (buffer.pop() for _ in range(187)) if item is not None]
    assert lanes[:17].count("batch") <= 3
    assert 8 <= lanes.count("batch") <= 16  # ~1/17 of 187 = 11


def test_remove_keeps_counts_and_rotation_consistent() -> None:
    buffer: FairQueue[Item] = FairQueue(WEIGHTS, tenant_quantum=100)
    items = [Item(f"t{i % 3}", "standard") for i in range(9)]
    for item in items:
        buffer.push(item)
    assert buffer.remove(items[0]) and not buffer.remove(items[0])
    for item in items[3::3]:
        buffer.remove(item)
    assert len(buffer) == 6 and buffer.count("standard") == 6
    popped = [buffer.pop() for _ in range(6)]
    assert all(p is not None for p in popped) and buffer.pop() is None
    assert {p.tenant_id for p in popped if p is not None} == {"t1", "t2"}


def test_a_tenant_arriving_after_another_filled_the_engine_catches_up_first() -> None:
    """Heavy's records came first and 8 of its requests went into the engine before
    light's were polled: light is served until its cost in the engine is within a quantum
    of heavy's, then DRR alternates."""
    queues: TenantQueues[Item] = TenantQueues(quantum=100)
    for _ in range(8):
        queues.started(Item("heavy", "standard"))
    for _ in range(50):
        queues.push(Item("heavy", "standard"))
    for _ in range(20):
        queues.push(Item("light", "standard"))
    order = []
    for _ in range(14):
        item = queues.pop()
        assert item is not None
        queues.started(item)
        order.append(item.tenant_id)
    assert order[:7] == ["light"] * 7  # 700 behind heavy's 800: within a quantum now
    assert order[7:].count("light") in (3, 4)  # then shared
    for _ in range(8):
        queues.left(Item("heavy", "standard"))
    assert queues.pop().tenant_id == "heavy"  # type: ignore[union-attr]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _shares(
    buffer: FairQueue[Item], lanes: tuple[str, str], pops: int, deadline: float
) -> dict[str, int]:
    for _ in range(pops):
        for lane in lanes:
            buffer.push(Item("t", lane, deadline=deadline))
    taken = [item.lane for item in (buffer.pop() for _ in range(pops)) if item is not None]
    return {lane: taken.count(lane) for lane in lanes}


def test_a_batch_lane_weighs_more_as_its_deadline_nears_up_to_the_urgent_lanes_weight() -> None:
    clock = Clock()
    buffer: FairQueue[Item] = FairQueue(
        WEIGHTS, tenant_quantum=100, deadline_horizon_s=1000.0, clock=clock
    )
    far = Item("t", "batch", deadline=clock.now + 5000.0)
    buffer.push(far)
    assert buffer.weight("batch") == 1  # outside the horizon: its own weight
    clock.now += 4500.0  # halfway through the horizon
    assert buffer.weight("batch") == pytest.approx(1 + (16 - 1) * 0.5)
    clock.now += 500.0
    assert buffer.weight("batch") == 16  # at the deadline: the urgent lane's, never more
    clock.now += 500.0
    assert buffer.weight("batch") == 16
    assert buffer.weight("standard") == 4  # other lanes keep theirs


def test_a_batch_near_its_deadline_takes_an_equal_share_beside_interactive_and_no_more() -> None:
    clock = Clock()
    near: FairQueue[Item] = FairQueue(
        WEIGHTS, tenant_quantum=100, deadline_horizon_s=60.0, clock=clock
    )
    shares = _shares(near, ("interactive", "batch"), 200, deadline=clock.now)  # due now
    assert 95 <= shares["batch"] <= shares["interactive"] + 1

    calm: FairQueue[Item] = FairQueue(
        WEIGHTS, tenant_quantum=100, deadline_horizon_s=60.0, clock=clock
    )
    shares = _shares(calm, ("interactive", "batch"), 170, deadline=clock.now + 600.0)
    assert 6 <= shares["batch"] <= 14  # far from its deadline: 16:1 as before


def test_deadlines_outside_the_deadline_lanes_change_nothing() -> None:
    clock = Clock()
    buffer: FairQueue[Item] = FairQueue(
        WEIGHTS, tenant_quantum=100, deadline_horizon_s=1000.0, clock=clock
    )
    buffer.push(Item("t", "standard", deadline=clock.now + 1.0))  # a client's timeout
    assert buffer.weight("standard") == 4
