"""The engine worker's fair queue: priority-weighted lanes, tenant-fair within.

Sits between the Kafka poll (which adds requests, a micro-batch at a time) and the
engine (which takes them one by one as capacity allows). Two levels:

- Lanes: the most urgent backlogged lane goes next, unless a less urgent backlogged
  lane has fallen below its minimum share of the recently admitted tokens (weights
  normalised over the backlogged lanes; service decays geometrically per admission).
  With weights 16/4/1 a batch backlog gets 1/17 of the tokens beside an interactive
  one: interactive is served first, batch never starves.
- Within a lane, tenants share by deficit round robin on tokens (cost = prompt +
  max_tokens): a tenant with 10x the load gets no more than its share while others
  are backlogged. DRR only orders admissions; a tenant that shows up after another
  filled the engine (its records came later in the poll) would stay behind by that
  head start. So a tenant whose cost in the engine trails another's by more than a
  quantum is served first until it catches up (the worker reports `started`/`left`).
- Deadlines: a batch line carries its batch's deadline. As the earliest deadline queued
  in a deadline lane (batch) comes within `deadline_horizon_s`, that lane's weight rises
  linearly from its own to the most urgent lane's, reached at the deadline: a batch
  near the end of its window gets up to an equal share with interactive work, never
  more, so the urgent lane keeps its place (it also passes a full engine queue, and the
  engine's priority scheduling serves it first).

Pure bookkeeping, no I/O; owned by the worker's event loop thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Generic, Protocol, TypeVar


class Admissible(Protocol):
    @property
    def tenant_id(self) -> str: ...

    @property
    def lane(self) -> str: ...

    @property
    def cost(self) -> int: ...

    @property
    def deadline(self) -> float | None: ...  # time.monotonic() seconds


T = TypeVar("T", bound=Admissible)

# a batch lane's weight starts rising this long before its earliest deadline
DEADLINE_HORIZON_S = 3600.0


class TenantQueues(Generic[T]):
    """Deficit round robin over per-tenant FIFO queues, cost in tokens."""

    def __init__(self, quantum: int) -> None:
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self.quantum = quantum
        self._queues: dict[str, deque[T]] = {}
        self._deficit: dict[str, int] = {}
        self._active: deque[str] = deque()
        self._head_credited = False
        self._len = 0
        self._in_engine: dict[str, int] = {}  # tenant → cost of its requests in the engine

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        for queue in self._queues.values():
            yield from queue

    def push(self, item: T) -> None:
        queue = self._queues.get(item.tenant_id)
        if queue is None:
            queue = self._queues[item.tenant_id] = deque()
            self._deficit[item.tenant_id] = 0
            self._active.append(item.tenant_id)
        queue.append(item)
        self._len += 1

    def started(self, item: T) -> None:
        """`item` went into the engine."""
        self._in_engine[item.tenant_id] = self._in_engine.get(item.tenant_id, 0) + item.cost

    def left(self, item: T) -> None:
        """`item` left the engine (finished, aborted, or not started after all)."""
        left = self._in_engine.get(item.tenant_id, 0) - item.cost
        if left > 0:
            self._in_engine[item.tenant_id] = left
        else:
            self._in_engine.pop(item.tenant_id, None)

    def _behind(self) -> str | None:
        """A queued tenant whose cost in the engine trails another queued tenant's by
        more than a quantum (the least served first), or None."""
        if len(self._active) < 2 or not self._in_engine:
            return None
        load = {tenant: self._in_engine.get(tenant, 0) for tenant in self._active}
        low = min(self._active, key=load.__getitem__)
        return low if max(load.values()) - load[low] > self.quantum else None

    def pop(self) -> T | None:
        """The next item: a tenant catching up first (see the module doc), else DRR."""
        behind = self._behind()
        if behind is not None:
            item = self._queues[behind][0]
            self.remove(item)
            return item
        while self._active:
            tenant = self._active[0]
            queue = self._queues[tenant]
            if not self._head_credited:
                self._deficit[tenant] += self.quantum
                self._head_credited = True
            if queue[0].cost <= self._deficit[tenant]:
                item = queue.popleft()
                self._deficit[tenant] -= item.cost
                self._len -= 1
                if not queue:
                    self._drop_head(tenant)
                return item
            self._active.rotate(-1)
            self._head_credited = False
        return None

    def remove(self, item: T) -> bool:
        queue = self._queues.get(item.tenant_id)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        self._len -= 1
        if not queue:
            if self._active and self._active[0] == item.tenant_id:
                self._drop_head(item.tenant_id)
            else:
                self._active.remove(item.tenant_id)
                del self._queues[item.tenant_id], self._deficit[item.tenant_id]
        return True

    def _drop_head(self, tenant: str) -> None:
        self._active.popleft()
        del self._queues[tenant], self._deficit[tenant]
        self._head_credited = False


class FairQueue(Generic[T]):
    """Lanes (weighted, by urgency) of tenant queues (DRR); see the module docstring.

    lane_weights: lane name → weight, most urgent first. decay: how much of the
    remembered service survives each admission (0.97 ≈ the last ~30 admissions).
    deadline_lanes: the lanes whose weight rises as their earliest deadline nears, over
    the last `deadline_horizon_s` before it. Only those: an interactive request's
    deadline is its client's timeout, not a window to finish in.
    """

    def __init__(
        self,
        lane_weights: Mapping[str, int],
        tenant_quantum: int,
        decay: float = 0.97,
        *,
        deadline_lanes: Collection[str] = ("batch",),
        deadline_horizon_s: float = DEADLINE_HORIZON_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lane_weights or min(lane_weights.values()) < 1:
            raise ValueError(f"lane weights must be >= 1, got {dict(lane_weights)}")
        if deadline_horizon_s <= 0:
            raise ValueError(f"deadline_horizon_s must be > 0, got {deadline_horizon_s}")
        self.weights = dict(lane_weights)
        self.decay = decay
        self.deadline_lanes = frozenset(deadline_lanes) & set(lane_weights)
        self.deadline_horizon_s = deadline_horizon_s
        self._clock = clock
        self._lanes: dict[str, TenantQueues[T]] = {
            lane: TenantQueues(tenant_quantum) for lane in lane_weights
        }
        self._served: dict[str, float] = dict.fromkeys(lane_weights, 0.0)

    def __len__(self) -> int:
        return sum(len(q) for q in self._lanes.values())

    def __iter__(self) -> Iterator[T]:
        for queues in self._lanes.values():
            yield from queues

    def count(self, lane: str) -> int:
        return len(self._lanes[lane])

    def push(self, item: T) -> None:
        self._lanes[item.lane].push(item)

    def weight(self, lane: str) -> float:
        """The lane's weight now: its own, raised as its earliest deadline nears."""
        base = self.weights[lane]
        if lane not in self.deadline_lanes:
            return base
        # a scan of the lane: the buffer holds at most a few hundred requests
        deadlines = [i.deadline for i in self._lanes[lane] if i.deadline is not None]
        if not deadlines:
            return base
        slack_s = min(deadlines) - self._clock()
        pressure = min(1.0, max(0.0, 1.0 - slack_s / self.deadline_horizon_s))
        return base + (max(self.weights.values()) - base) * pressure

    def _next_lane(self) -> str | None:
        backlogged = [lane for lane, queues in self._lanes.items() if queues]
        if not backlogged:
            return None
        weights = {lane: self.weight(lane) for lane in backlogged}
        served = sum(self._served[lane] for lane in backlogged)
        weight = sum(weights.values())
        best, best_deficit = backlogged[0], 0.0
        for lane in backlogged:
            deficit = served * weights[lane] / weight - self._served[lane]
            if deficit > best_deficit:
                best, best_deficit = lane, deficit
        return best  # the lane furthest below its share, else the most urgent one

    def pop(self, lane: str | None = None) -> T | None:
        """The next item: of the lane `_next_lane` picks, or of `lane` when given."""
        lane = lane if lane is not None else self._next_lane()
        if lane is None:
            return None
        item = self._lanes[lane].pop()
        for name in self._served:
            self._served[name] *= self.decay
        if item is not None:
            self._served[lane] += item.cost
        return item

    def remove(self, item: T) -> bool:
        return self._lanes[item.lane].remove(item)

    def started(self, item: T) -> None:
        self._lanes[item.lane].started(item)

    def left(self, item: T) -> None:
        self._lanes[item.lane].left(item)
