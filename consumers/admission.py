"""The engine worker's local admission buffer: priority-weighted lanes, tenant-fair within.

Sits between the Kafka poll (which adds requests, a micro-batch at a time) and the
engine (which takes them one by one as capacity allows). Two levels:

- Lanes share the engine by weighted fair queueing on tokens (stride scheduling): each
  lane's virtual time advances by cost / weight when it is served, the backlogged lane
  with the smallest virtual time goes next, ties to the more urgent lane. A lane that
  was idle re-enters at the current minimum, so it cannot bank credit. With weights
  16/4/1 a backlogged batch lane still gets 1/21 of the tokens: it never starves.
- Within a lane, tenants share by deficit round robin on tokens (cost = prompt +
  max_tokens): a tenant with 10x the load gets no more than its share while others
  are backlogged.

Pure bookkeeping, no I/O; owned by the worker's event loop thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Generic, Protocol, TypeVar


class Admissible(Protocol):
    @property
    def tenant_id(self) -> str: ...

    @property
    def lane(self) -> str: ...

    @property
    def cost(self) -> int: ...


T = TypeVar("T", bound=Admissible)


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

    def pop(self) -> T | None:
        """The next item in DRR order, or None when empty."""
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


class AdmissionBuffer(Generic[T]):
    """Lanes (weighted, by urgency) of tenant queues (DRR); see the module docstring.

    lane_weights: lane name → weight, most urgent first (the order breaks ties).
    """

    def __init__(self, lane_weights: Mapping[str, int], tenant_quantum: int) -> None:
        if not lane_weights or min(lane_weights.values()) < 1:
            raise ValueError(f"lane weights must be >= 1, got {dict(lane_weights)}")
        self.weights = dict(lane_weights)
        self._lanes: dict[str, TenantQueues[T]] = {
            lane: TenantQueues(tenant_quantum) for lane in lane_weights
        }
        self._vtime: dict[str, float] = dict.fromkeys(lane_weights, 0.0)

    def __len__(self) -> int:
        return sum(len(q) for q in self._lanes.values())

    def __iter__(self) -> Iterator[T]:
        for queues in self._lanes.values():
            yield from queues

    def count(self, lane: str) -> int:
        return len(self._lanes[lane])

    def push(self, item: T) -> None:
        queues = self._lanes[item.lane]
        if not queues:  # re-entering: no credit for the time it was idle
            busy = [self._vtime[lane] for lane, q in self._lanes.items() if q]
            if busy:
                self._vtime[item.lane] = max(self._vtime[item.lane], min(busy))
        queues.push(item)

    def pop(self) -> T | None:
        best: str | None = None
        for lane, queues in self._lanes.items():  # most urgent first: ties go to it
            if queues and (best is None or self._vtime[lane] < self._vtime[best]):
                best = lane
        if best is None:
            return None
        item = self._lanes[best].pop()
        if item is not None:
            self._vtime[best] += item.cost / self.weights[best]
        return item

    def remove(self, item: T) -> bool:
        return self._lanes[item.lane].remove(item)
