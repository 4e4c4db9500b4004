"""Low-watermark offset tracking for consumers whose records finish out of order.

The engine worker holds many requests of one partition at once and they finish in any
order; it may commit a partition only up to its lowest unfinished offset
(docs/architecture.md §5.2). `OffsetTracker` remembers, per partition, the offsets handed
out and not yet done, and which watermark was last committed.
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.bus.base import TopicPartition


class OffsetTracker:
    """Per partition: offsets in flight, the next offset after the highest seen, commits."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int) -> bool:
        """True when this record is already held or done (a redelivery after a rebalance)."""
        if offset in self._pending.get(tp, ()):
            return True
        committed = self._committed.get(tp, -1)
        return offset < max(self._next.get(tp, -1), committed) and offset >= committed

    def add(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        """Mark a record done; ignored for partitions no longer tracked."""
        pending = self._pending.get(tp)
        if pending is not None:
            pending.discard(offset)

    def num_pending(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def watermark(self, tp: TopicPartition) -> int | None:
        pending = self._pending.get(tp)
        if pending:
            return min(pending)
        return self._next.get(tp)

    def watermarks(self) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        for tp in self._next:
            mark = self.watermark(tp)
            if mark is not None:
                out[tp] = mark
        return out

    def to_commit(self) -> dict[TopicPartition, int]:
        """Watermarks that moved past the last committed offset."""
        return {
            tp: mark for tp, mark in self.watermarks().items() if mark > self._committed.get(tp, -1)
        }

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            if tp in self._next:
                self._committed[tp] = max(self._committed.get(tp, -1), offset)

    def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget partitions this member lost in a rebalance."""
        for tp in partitions:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)
