"""`MemoryEventBus`: the in-process transport used by `sluice serve` and by tests.

Implements the same contract as Kafka (docs/architecture.md §2): partitions with offsets, consumer
groups whose members share the partitions, committed offsets, redelivery of uncommitted
messages when a member leaves, pause/resume. A fake in the Dramatiq sense: a real
implementation of `EventBus`, not a mock.

Retention: `sluice serve` runs on this bus for days, so each partition keeps its newest
records, at most `retention_records` of them and `retention_bytes` of values (for a late
group that replays the topic, as Kafka's retention.bytes allows: a delta batch with top
logprobs of 32 streams is tens of KB), and, older than those, only what some group may
still read (see `_pin`). Offsets
stay absolute: a trimmed log keeps the offset of its first record, Kafka's start offset.
A group left without members keeps its commits for `empty_group_retention_s` (Kafka's
offsets.retention.minutes), then is forgotten: a gateway's reply group, one per
instance, is never joined again and must not pin its topic for good.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from sluice.bus.base import (
    Consumer,
    Delivered,
    Headers,
    OffsetReset,
    RebalanceCallback,
    Record,
    TopicPartition,
    TopicSpec,
)
from sluice.bus.errors import BusError, CommitFailed, TopicError
from sluice.bus.partitioner import partition_for

_member_ids = itertools.count(1)


class _Log:
    """One partition: the retained records and the absolute offset of the first one."""

    __slots__ = ("base", "nbytes", "records")

    def __init__(self) -> None:
        self.base = 0
        self.nbytes = 0  # of the retained records' values
        self.records: list[Record] = []

    def append(self, record: Record) -> None:
        self.records.append(record)
        self.nbytes += len(record.value)

    @property
    def end(self) -> int:
        return self.base + len(self.records)

    def read(self, offset: int, max_records: int) -> list[Record]:
        start = offset - self.base
        return self.records[start : start + max_records]

    def trim(self, offset: int) -> None:
        """Drop the records before `offset` (never past the end)."""
        offset = min(offset, self.end)
        if offset > self.base:
            dropped = offset - self.base
            self.nbytes -= sum(len(r.value) for r in self.records[:dropped])
            del self.records[:dropped]
            self.base = offset

    def over(self, max_records: int, max_bytes: int) -> bool:
        return len(self.records) > max_records or self.nbytes > max_bytes

    def window_start(self, max_records: int, max_bytes: int, limit: int) -> int:
        """Where the newest records, at most `max_records` of them and `max_bytes` of
        values, begin; never past `limit` (what a group may still read). Walks only the
        records it drops."""
        offset, count, nbytes = self.base, len(self.records), self.nbytes
        while offset < limit and (count > max_records or nbytes > max_bytes):
            nbytes -= len(self.records[offset - self.base].value)
            offset += 1
            count -= 1
        return offset


class _Group:
    """Membership, assignment and committed offsets of one consumer group."""

    def __init__(self) -> None:
        self.members: dict[int, MemoryConsumer] = {}
        self.generation = 0
        self.assignment: dict[int, set[TopicPartition]] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.empty_since: float | None = None  # when the last member left


class MemoryEventBus:
    """All topics live in lists guarded by one condition variable."""

    def __init__(
        self,
        default_partitions: int = 1,
        retention_records: int = 256,
        retention_bytes: int = 1 << 20,
        empty_group_retention_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default_partitions = default_partitions
        self._retention_records = retention_records
        self._retention_bytes = retention_bytes
        self._empty_group_retention_s = empty_group_retention_s
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the bus's lock, held as a context
        # who waits for a topic's records: a publish wakes only its readers, not every
        # consumer thread of `sluice serve` (reply, engine poller, billing, quotas,
        # tracing), each of which would take the GIL to find nothing
        self._readers: dict[str, set[MemoryConsumer]] = {}
        self._logs: dict[str, list[_Log]] = {}
        self._groups: dict[str, _Group] = {}
        self._closed = False

    # -- topics ---------------------------------------------------------------------
    def create_topics(self, topics: Sequence[TopicSpec]) -> None:
        with self._cond:
            for spec in topics:
                if spec.name not in self._logs:
                    self._logs[spec.name] = [_Log() for _ in range(spec.num_partitions)]

    def num_partitions(self, topic: str) -> int:
        with self._cond:
            return len(self._partitions(topic))

    def _partitions(self, topic: str) -> list[_Log]:
        # Like a broker with auto-create on, an unknown topic appears with the default.
        if topic not in self._logs:
            self._logs[topic] = [_Log() for _ in range(self._default_partitions)]
        return self._logs[topic]

    # -- producing ------------------------------------------------------------------
    def publish(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> Future[Delivered]:
        future: Future[Delivered] = Future()
        with self._cond:
            if self._closed:
                future.set_exception(BusError("bus is closed"))
                return future
            parts = self._partitions(topic)
            if partition is None:
                partition = partition_for(key, len(parts))
            elif not 0 <= partition < len(parts):
                future.set_exception(TopicError(f"{topic} has no partition {partition}"))
                return future
            log = parts[partition]
            record = Record(
                topic=topic,
                partition=partition,
                offset=log.end,
                key=key,
                value=value,
                headers=list(headers or []),
                timestamp_ms=int(time.time() * 1000),
            )
            log.append(record)
            self._trim(TopicPartition(topic, partition))
            for reader in self._readers.get(topic, ()):
                reader._wake.notify()
        future.set_result(Delivered(topic, partition, record.offset))
        return future

    def flush(self, timeout_s: float = 10.0) -> None:
        """Every publish is confirmed before it returns; nothing to wait for."""

    # -- consuming ------------------------------------------------------------------
    def consumer(
        self,
        group_id: str,
        topics: Sequence[str],
        *,
        offset_reset: OffsetReset = "earliest",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        max_wait_ms: int | None = None,
    ) -> MemoryConsumer:
        with self._cond:
            for topic in topics:
                self._partitions(topic)
            group = self._groups.setdefault(group_id, _Group())
            member = MemoryConsumer(self, group, list(topics), offset_reset, on_assign, on_revoke)
            for topic in topics:
                self._readers.setdefault(topic, set()).add(member)
            group.members[member.member_id] = member
            group.empty_since = None
            self._rebalance(group)
            return member

    def _rebalance(self, group: _Group) -> None:
        """Round-robin every subscribed partition over the members that subscribe to it."""
        group.generation += 1
        assignment: dict[int, set[TopicPartition]] = {mid: set() for mid in group.members}
        topics = sorted({t for m in group.members.values() for t in m.topics})
        for topic in topics:
            subscribers = sorted(mid for mid, m in group.members.items() if topic in m.topics)
            for p in range(len(self._partitions(topic))):
                assignment[subscribers[p % len(subscribers)]].add(TopicPartition(topic, p))
        group.assignment = assignment
        self._wake_all()

    def _wake_all(self) -> None:
        """Every waiting reader polls again (a rebalance, a resume, the bus closing)."""
        for readers in self._readers.values():
            for reader in readers:
                reader._wake.notify_all()

    def _leave(self, member: MemoryConsumer) -> None:
        with self._cond:
            group = member.group
            if group.members.pop(member.member_id, None) is None:
                return
            for topic in member.topics:
                self._readers.get(topic, set()).discard(member)
            self._rebalance(group)
            if not group.members:
                group.empty_since = self._clock()
                if not group.committed:  # it resumes nowhere: forget it now
                    self._groups = {k: g for k, g in self._groups.items() if g is not group}
            for topic in member.topics:
                for p in range(len(self._partitions(topic))):
                    self._trim(TopicPartition(topic, p))

    # -- retention (callers hold the condition) ----------------------------------------
    def _trim(self, tp: TopicPartition) -> None:
        """Drop the records older than the retention window that no group will read."""
        log = self._partitions(tp.topic)[tp.partition]
        if not log.over(self._retention_records, self._retention_bytes):
            return
        self._expire_empty_groups()
        pins = [pin for g in self._groups.values() if (pin := _pin(g, tp, log)) is not None]
        limit = min([log.end, *pins])
        log.trim(log.window_start(self._retention_records, self._retention_bytes, limit))

    def _expire_empty_groups(self) -> None:
        horizon = self._clock() - self._empty_group_retention_s
        expired = [
            k
            for k, g in self._groups.items()
            if g.empty_since is not None and g.empty_since <= horizon
        ]
        for group_id in expired:
            del self._groups[group_id]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._wake_all()

    def end_offset(self, tp: TopicPartition) -> int:
        with self._cond:
            return self._partitions(tp.topic)[tp.partition].end

    def start_offset(self, tp: TopicPartition) -> int:
        """The oldest offset still retained (Kafka's log start offset)."""
        with self._cond:
            return self._partitions(tp.topic)[tp.partition].base

    def num_retained(self, topic: str | None = None) -> int:
        """Records held in memory, in `topic` or in all topics."""
        with self._cond:
            topics = list(self._logs) if topic is None else [topic]
            return sum(len(log.records) for t in topics for log in self._partitions(t))


def _pin(group: _Group, tp: TopicPartition, log: _Log) -> int | None:
    """The lowest offset of `tp` that `group` may still read; None if it reads none.

    A member that owns `tp` reads from its position, and after a rebalance the group
    resumes at the committed offset, else at the reset point: 'latest' needs nothing
    kept, 'earliest' needs the whole log. An owner not yet synced with the group's
    generation has no position yet, so the log is kept from its start until it has.
    """
    committed = group.committed.get(tp)
    owner = next((m for m in group.members.values() if tp in m.topic_partitions()), None)
    if owner is None:
        return committed
    position = owner.position(tp)
    if position is None:
        return log.base if committed is None else committed
    if committed is not None:
        return min(committed, position)
    return position if owner.offset_reset == "latest" else log.base


class MemoryConsumer(Consumer):
    """One group member. Rebalances are applied at the start of `poll`, as in Kafka."""

    def __init__(
        self,
        bus: MemoryEventBus,
        group: _Group,
        topics: list[str],
        offset_reset: OffsetReset,
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
    ) -> None:
        self.member_id = next(_member_ids)
        self.topics = topics
        self.group = group
        self._bus = bus
        self.offset_reset = offset_reset
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._generation = 0
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._closed = False
        self._wake = threading.Condition(bus._lock)  # notified by the bus (`_readers`)

    def _sync_assignment(self) -> None:
        """Adopt the group's current assignment (eager: revoke all, then assign)."""
        bus, group = self._bus, self.group
        with bus._cond:
            if self._generation == group.generation:
                return
            new = set(group.assignment.get(self.member_id, set()))
            self._generation = group.generation
            self._positions = {}  # none until the new ones are set below
        if self._assigned and self._on_revoke is not None:
            self._on_revoke(set(self._assigned))
        with bus._cond:
            self._assigned = new
            self._paused &= new
            self._positions = {}
            for tp in new:
                log = bus._partitions(tp.topic)[tp.partition]
                committed = group.committed.get(tp)
                if committed is None:
                    committed = log.base if self.offset_reset == "earliest" else log.end
                # a commit below the log's start resumes at the start, as Kafka's reset does
                self._positions[tp] = max(committed, log.base)
        if new and self._on_assign is not None:
            self._on_assign(set(new))

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        if self._closed:
            raise BusError("consumer is closed")
        deadline = time.monotonic() + timeout_s
        while True:
            self._sync_assignment()
            bus = self._bus
            with bus._cond:
                if self._generation == self.group.generation:
                    records = self._take(max_records)
                    if records:
                        return records
                remaining = deadline - time.monotonic()
                if remaining <= 0 or bus._closed:
                    return []
                if self._generation == self.group.generation:
                    self._wake.wait(remaining)

    def _take(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        for tp in sorted(self._assigned - self._paused):
            log = self._bus._partitions(tp.topic)[tp.partition]
            pos = self._positions[tp]
            if pos < log.end:
                batch = log.read(pos, max_records - len(out))
                out.extend(batch)
                self._positions[tp] = pos + len(batch)
                self._bus._trim(tp)  # what a group that never commits read may go now
                if len(out) >= max_records:
                    break
        return out

    # read by the bus's retention, under its condition
    def topic_partitions(self) -> set[TopicPartition]:
        """What the group assigned to this member at its current generation."""
        return self.group.assignment.get(self.member_id, set())

    def position(self, tp: TopicPartition) -> int | None:
        """The next offset this member reads from `tp`; None until it has synced."""
        if self._generation != self.group.generation:
            return None
        return self._positions.get(tp)

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        # in memory a commit takes no time: both ways commit here and now
        with self._bus._cond:
            if self._closed or self._generation != self.group.generation:
                raise CommitFailed("group rebalanced since the last poll; poll again")
            foreign = set(offsets) - self._assigned
            if foreign:
                raise CommitFailed(f"partitions not assigned to this member: {sorted(foreign)}")
            self.group.committed.update(offsets)
            for tp in offsets:
                self._bus._trim(tp)

    def committed(self, tp: TopicPartition) -> int | None:
        with self._bus._cond:
            return self.group.committed.get(tp)

    def assignment(self) -> set[TopicPartition]:
        self._sync_assignment()
        return set(self._assigned)

    def pause(self, partitions: Sequence[TopicPartition]) -> None:
        self._paused |= set(partitions) & self._assigned

    def resume(self, partitions: Sequence[TopicPartition]) -> None:
        self._paused -= set(partitions)
        with self._bus._cond:
            self._wake.notify_all()

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def lag(self) -> dict[TopicPartition, int]:
        with self._bus._cond:
            if self._generation != self.group.generation:
                return {}
            return {
                tp: max(0, self._bus._partitions(tp.topic)[tp.partition].end - position)
                for tp, position in self._positions.items()
            }

    def close(self) -> None:
        """Leave the group; on_revoke runs first, so it may still commit."""
        if self._closed:
            return
        if self._assigned and self._on_revoke is not None:
            self._on_revoke(set(self._assigned))
        self._closed = True
        self._bus._leave(self)
