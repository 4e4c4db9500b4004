"""The requests one engine worker holds, the partitions it owns, and their offsets.

A request is held from its poll until its offset may be committed (or another member
owns it). A partition is committed up to its low watermark (`consumers.offsets`);
`commit_snapshot` is the copy of the watermarks that the poll thread commits at a
rebalance (`consumers.engine_poller`), refreshed whenever an offset is released.
"""

from __future__ import annotations

from collections.abc import Iterator

from sluice.bus.base import TopicPartition
from sluice.consumers.offsets import OffsetTracker
from sluice.consumers.work_item import WorkItem


class HeldRequests:
    """Held requests by id; owned partitions; offsets and their committable snapshot."""

    def __init__(self) -> None:
        self._items: dict[str, WorkItem] = {}
        self._assigned: set[TopicPartition] = set()
        self.offsets = OffsetTracker()
        self.commit_snapshot: dict[TopicPartition, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[WorkItem]:
        """The held items; copy them (`list(held)`) to add or forget while iterating."""
        return iter(self._items.values())

    def get(self, request_id: str) -> WorkItem | None:
        return self._items.get(request_id)

    def assigned(self) -> set[TopicPartition]:
        return set(self._assigned)

    def owns(self, tp: TopicPartition) -> bool:
        return tp in self._assigned

    def accept(self, tp: TopicPartition, offset: int) -> bool:
        """Track a polled record's offset; False when this member does not own its
        partition, or already holds or did the record (redelivered after a rebalance)."""
        if tp not in self._assigned or self.offsets.seen(tp, offset):
            return False
        self.offsets.add(tp, offset)
        return True

    def hold(self, item: WorkItem) -> None:
        self._items[item.request_id] = item

    def forget(self, item: WorkItem) -> None:
        if self._items.get(item.request_id) is item:
            del self._items[item.request_id]

    def release(self, tp: TopicPartition, offset: int) -> None:
        """The record at `offset` is done: the watermark may pass it (`update_snapshot`)."""
        self.offsets.done(tp, offset)

    def update_snapshot(self) -> None:
        self.commit_snapshot = self.offsets.watermarks()

    def reassign(self, partitions: set[TopicPartition]) -> set[TopicPartition]:
        """The group's new assignment; returns the partitions lost, their offsets dropped."""
        lost = self._assigned - partitions
        self._assigned = set(partitions)
        if lost:
            self.offsets.drop(lost)
        return lost

    def on_partitions(self, partitions: set[TopicPartition]) -> list[WorkItem]:
        return [i for i in self._items.values() if i.tp in partitions]
