"""Admission: the fair buffer of polled requests, and whether the engine has room for more.

Polled requests wait in a `FairQueue` (priority-weighted lanes, tenant-fair within)
until the engine has room; `take` moves the next ones to STARTING and counts them as in
the engine until they leave it (`leave_engine`). The most urgent lane may pass an engine
queue full of less urgent work (`_take_urgent`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.bus.base import TopicPartition
from sluice.consumers.fair_queue import FairQueue
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.work_item import WorkItem
from sluice.consumers.worker_requests import is_expired
from sluice.engine.backends.base import EngineBackend


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """When the engine counts as full, and how much a partition may buffer; the fields of
    `consumers.engine_flow.FlowConfig` of the same names."""

    max_in_engine: int
    max_engine_waiting: int
    max_engine_waiting_tokens: int
    max_kv_usage: float
    max_buffered_per_partition: int
    full_engine_lookahead: int


class Admission:
    """The admission buffer and the count of requests admitted to the engine."""

    def __init__(
        self,
        buffer: FairQueue[WorkItem],
        urgent_lane: str,
        limits: EngineLimits,
        backend: EngineBackend,
        held: HeldRequests,
    ) -> None:
        self._buffer = buffer
        self._urgent_lane = urgent_lane
        self._limits = limits
        self._backend = backend
        self._held = held
        self.num_in_engine = 0

    def __len__(self) -> int:
        return len(self._buffer)

    def push(self, item: WorkItem) -> None:
        self._buffer.push(item)

    def remove(self, item: WorkItem) -> None:
        self._buffer.remove(item)

    def requeue(self, item: WorkItem) -> None:
        """Back to the buffer from STARTING or ORPHANED, to start again."""
        item.requeue()
        self._buffer.push(item)

    def take_all(self) -> list[WorkItem]:
        """Take every buffered item out of the buffer."""
        items = list(self._buffer)
        for item in items:
            self._buffer.remove(item)
        return items

    def take_expired(self) -> list[WorkItem]:
        """Take the buffered items past their deadline out of the buffer."""
        expired = [i for i in self._buffer if is_expired(i.deadline)]
        for item in expired:
            self._buffer.remove(item)
        return expired

    def partitions_to_pause(self, engine_full: bool) -> set[TopicPartition]:
        """Backpressure: partitions with enough buffered (a lookahead when the engine is full)."""
        limit = self._limits.max_buffered_per_partition
        if engine_full:
            limit = min(limit, self._limits.full_engine_lookahead)
        counts: dict[TopicPartition, int] = {}
        for item in self._buffer:
            counts[item.tp] = counts.get(item.tp, 0) + 1
        return {tp for tp, n in counts.items() if n >= limit}

    def engine_full(self, extra: int, unstarted_tokens: int | None = None) -> bool:
        """Whether the engine takes no more requests now (`extra` are on their way in).

        Besides the count of waiting requests, the prompt tokens of those without a first
        token yet (`unstarted_tokens`; counted here when None) are held to
        `max_engine_waiting_tokens`, about two steps' worth: enough that the engine's next
        step fills its token budget with prefills, while the rest of a burst waits in the
        fair queue. With a count alone, a burst of short prompts would reach the engine a
        few at a time and its last first tokens would wait several more steps.
        """
        limits = self._limits
        in_engine = self.num_in_engine + extra
        if in_engine >= limits.max_in_engine:
            return True
        stats = self._backend.stats()
        waiting = max(stats.num_waiting + stats.num_pending, in_engine - stats.num_running)
        if waiting >= limits.max_engine_waiting or stats.kv_usage >= limits.max_kv_usage:
            return True
        if unstarted_tokens is None:
            unstarted_tokens = self._unstarted()[1]
        return unstarted_tokens >= limits.max_engine_waiting_tokens

    def _unstarted(self, lane: str | None = None) -> tuple[int, int]:
        """The requests in the engine (of `lane`, or all) without a first token yet, and
        their prompt tokens."""
        items = [
            i
            for i in self._held
            if i.in_engine and i.first_token_ms is None and lane in (None, i.lane)
        ]
        return len(items), sum(i.prompt_tokens for i in items)

    def take(self) -> list[WorkItem]:
        """The buffered items the engine has room for, fairly chosen, now STARTING and
        counted as in the engine."""
        batch: list[WorkItem] = []
        unstarted = self._unstarted()[1]
        while not self.engine_full(len(batch), unstarted):
            item = self._buffer.pop()
            if item is None:
                break
            item.start()
            batch.append(item)
            unstarted += item.prompt_tokens
        self._take_urgent(batch)
        if batch:
            self.num_in_engine += len(batch)
            for item in batch:
                item.in_engine = True
                self._buffer.started(item)
        return batch

    def _take_urgent(self, batch: list[WorkItem]) -> None:
        """The most urgent lane passes an engine queue full of less urgent work.

        Under a saturating batch backlog the engine's waiting queue stays full of batch
        requests (preempted ones go back to it) that only leave as running ones finish,
        so the lane-blind `engine_full` would hold an interactive request for seconds.
        The engine's priority scheduling serves it first (and preempts for it), so it may
        enter while fewer than `max_engine_waiting` requests (and `max_engine_waiting_tokens`
        prompt tokens) of its own lane wait in the engine for their first token;
        `max_in_engine` and `max_kv_usage` still hold. Counting its running requests
        instead would hold new ones in this buffer (and pause the lane's partition)
        whenever a few interactive requests are decoding.
        """
        lane, limits = self._urgent_lane, self._limits
        if not self._buffer.count(lane):
            return
        urgent, tokens = self._unstarted(lane)
        for entering in batch:  # not in the engine yet
            if entering.lane == lane:
                urgent += 1
                tokens += entering.prompt_tokens
        while (
            self._buffer.count(lane)
            and urgent < limits.max_engine_waiting
            and tokens < limits.max_engine_waiting_tokens
        ):
            if self.num_in_engine + len(batch) >= limits.max_in_engine:
                return
            if self._backend.stats().kv_usage >= limits.max_kv_usage:
                return
            item = self._buffer.pop(lane)
            if item is None:
                return
            item.start()
            batch.append(item)
            urgent += 1
            tokens += item.prompt_tokens

    def leave_engine(self, item: WorkItem) -> None:
        """`item` no longer counts against the engine's capacity (if it did)."""
        if item.in_engine:
            item.in_engine = False
            self.num_in_engine -= 1
            self._buffer.left(item)
