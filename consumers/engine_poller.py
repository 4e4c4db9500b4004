"""The engine worker's side of the bus consumers: one thread polls, commits and pauses.

Sits between the lane topics / control topic and the worker's event loop. A bus
`Consumer` is not thread-safe, so both consumers live on one dedicated thread (a
single-worker executor): each `cycle()` commits the offsets the worker asks for,
pauses or resumes lanes to match its backpressure decision, and polls. Polling goes on
while every partition is paused, so the member keeps its place in the group.

Rebalances are reported to the event loop through `on_assignment`; on revocation the
last low-watermark snapshot is committed first (Kafka's usual commit-on-revoke), so the
next owner starts as late as is safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sluice.bus.base import Consumer, EventBus, Record, TopicPartition
from sluice.bus.errors import BusError
from sluice.bus.topics import CONTROL_TOPIC, HEARTBEATS_TOPIC

logger = logging.getLogger(__name__)

AssignmentCallback = Callable[[set[TopicPartition]], None]


@dataclass(slots=True)
class PollResult:
    records: list[Record] = field(default_factory=list)
    controls: list[Record] = field(default_factory=list)
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    assignment: set[TopicPartition] = field(default_factory=set)
    paused: set[TopicPartition] = field(default_factory=set)


class LanePoller:
    """Owns the lane consumer (group `group_id`) and the control consumer (own group).

    Every method must run on the same thread.
    """

    def __init__(
        self,
        bus: EventBus,
        group_id: str,
        topics: Sequence[str],
        control_group_id: str,
        on_assignment: AssignmentCallback,
        commit_snapshot: Callable[[], Mapping[TopicPartition, int]],
        control_max_wait_ms: int | None = None,
    ) -> None:
        self.bus = bus
        self.group_id = group_id
        self.topics = list(topics)
        self.control_group_id = control_group_id
        self._on_assignment = on_assignment
        self._control_max_wait_ms = control_max_wait_ms
        self._commit_snapshot = commit_snapshot
        self._consumer: Consumer | None = None
        self._control: Consumer | None = None
        self._early_controls: list[Record] = []
        self.join_timeout_s = 30.0

    def open_control(self) -> None:
        """Join the control group; may run while the engine loads (a join takes the
        broker's rebalance delay, seconds a pool scaling from zero would wait on)."""
        self._control = self.bus.consumer(
            self.control_group_id,
            [CONTROL_TOPIC, HEARTBEATS_TOPIC],
            offset_reset="latest",
            max_wait_ms=self._control_max_wait_ms,
        )
        self._join_control()

    def open_lanes(self) -> None:
        """Subscribe to the lanes: after `open_control`, once the engine is up."""
        self._consumer = self.bus.consumer(
            self.group_id, self.topics, on_assign=self._assigned, on_revoke=self._revoked
        )

    def _join_control(self) -> None:
        """Join the control group before serving: its 'latest' position is taken at
        assignment, so a cancel published before then would never be seen; wait here."""
        control = self._control
        assert control is not None
        deadline = time.monotonic() + self.join_timeout_s
        while not control.assignment() and time.monotonic() < deadline:
            self._early_controls += control.poll(0.2, 500)
        if not control.assignment():
            logger.warning(
                "group=%s not joined after %.0fs", self.control_group_id, self.join_timeout_s
            )

    def _assigned(self, partitions: set[TopicPartition]) -> None:
        logger.info("group=%s assigned %s", self.group_id, sorted(partitions))
        self._on_assignment(set(partitions))

    def _revoked(self, partitions: set[TopicPartition]) -> None:
        consumer = self._consumer
        snapshot = self._commit_snapshot()
        offsets = {tp: off for tp, off in snapshot.items() if tp in partitions}
        if consumer is not None and offsets:
            try:
                consumer.commit(offsets)
            except BusError as exc:
                logger.warning("group=%s commit on revoke failed: %s", self.group_id, exc)
        logger.info("group=%s revoked %s", self.group_id, sorted(partitions))

    def cycle(
        self,
        commits: Mapping[TopicPartition, int],
        pause: set[TopicPartition],
        timeout_s: float,
        max_records: int,
    ) -> PollResult:
        consumer, control = self._consumer, self._control
        if consumer is None or control is None:
            raise RuntimeError("LanePoller.cycle before open()")
        result = PollResult()
        # the periodic commit does not wait for the broker: a record arriving meanwhile
        # would wait for its round trip; one that fails only widens what a failover redoes
        result.committed = self.commit(commits, wait=False)
        self._reconcile_pause(consumer, pause)
        result.controls = [*self._early_controls, *control.poll(0.0, 500)]
        self._early_controls = []
        result.records = consumer.poll(timeout_s, max_records)
        result.assignment = consumer.assignment()
        # a rebalance inside poll() can clear pauses: reapply before the next fetch
        self._reconcile_pause(consumer, pause)
        result.paused = consumer.paused()
        return result

    def commit(
        self, commits: Mapping[TopicPartition, int], wait: bool = True
    ) -> dict[TopicPartition, int]:
        consumer = self._consumer
        if consumer is None or not commits:
            return {}
        owned = consumer.assignment()
        offsets = {tp: off for tp, off in commits.items() if tp in owned}
        if not offsets:
            return {}
        try:
            consumer.commit(offsets, wait=wait)
        except BusError as exc:
            logger.warning("group=%s commit failed: %s", self.group_id, exc)
            return {}
        return offsets

    def _reconcile_pause(self, consumer: Consumer, pause: set[TopicPartition]) -> None:
        assigned = consumer.assignment()
        want = pause & assigned
        paused = consumer.paused()
        if want - paused:
            consumer.pause(sorted(want - paused))
        if (paused & assigned) - want:
            consumer.resume(sorted((paused & assigned) - want))

    def close(self) -> None:
        for consumer in (self._consumer, self._control):
            if consumer is not None:
                try:
                    consumer.close()
                except BusError as exc:
                    logger.warning("group=%s close failed: %s", self.group_id, exc)
        self._consumer = self._control = None
