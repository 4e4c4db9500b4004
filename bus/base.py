"""The `EventBus` protocol every transport implements, and its plain records.

Sits under everything that crosses a process boundary: the gateway publishes through it,
the shared consume loop polls through it. Kafka semantics are the reference: keyed
partitions, consumer groups with manual commits, pause/resume, rebalance callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

Headers = list[tuple[str, bytes]]
OffsetReset = Literal["earliest", "latest"]


class TopicPartition(NamedTuple):
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic to create: its name and partition count."""

    name: str
    num_partitions: int = 1


@dataclass(frozen=True, slots=True)
class Record:
    """One message as a consumer sees it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Headers = field(default_factory=list)
    timestamp_ms: int = 0

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Delivered:
    """Where a published message landed, once the bus confirmed it."""

    topic: str
    partition: int
    offset: int


RebalanceCallback = Callable[[set[TopicPartition]], None]


class Consumer(Protocol):
    """A member of a consumer group. Not thread-safe: one thread polls, commits, closes.

    Rebalance callbacks run on the polling thread, inside `poll` (and `on_revoke` inside
    `close`, where it may still commit); they are never called with an empty set.
    Offsets committed are the *next* offset to read, as in Kafka. Nothing is committed
    unless `commit` is called; when a member leaves, its partitions go to the remaining
    members, which resume at the last committed offsets (so uncommitted messages are
    delivered again).
    """

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]: ...

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        """Commit, and with `wait` return once the broker took it (else raise).

        `wait=False` hands the commit over and returns at once; a failure is logged, not
        raised (a later commit, or the redelivery after a rebalance, covers it)."""
        ...

    def assignment(self) -> set[TopicPartition]: ...

    def pause(self, partitions: Sequence[TopicPartition]) -> None: ...

    def resume(self, partitions: Sequence[TopicPartition]) -> None: ...

    def paused(self) -> set[TopicPartition]: ...

    def lag(self) -> dict[TopicPartition, int]:
        """Records not yet consumed per assigned partition: the high watermark minus
        this member's position (metrics; a partition it cannot tell of is left out)."""
        ...

    def close(self) -> None: ...


class EventBus(Protocol):
    """Keyed publish with delivery confirmation, and consumer groups.

    `publish` never blocks on the network: it returns a future that resolves to
    `Delivered` or fails with `DeliveryFailed`. Messages with the same key land in the
    same partition and keep their order.
    """

    def create_topics(self, topics: Sequence[TopicSpec]) -> None: ...

    def num_partitions(self, topic: str) -> int: ...

    def publish(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> Future[Delivered]: ...

    def flush(self, timeout_s: float = 10.0) -> None: ...

    def consumer(
        self,
        group_id: str,
        topics: Sequence[str],
        *,
        offset_reset: OffsetReset = "earliest",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        max_wait_ms: int | None = None,
    ) -> Consumer:
        """A group member over `topics`. `max_wait_ms`: how long the broker may hold a
        fetch that finds nothing, which bounds what polling adds to a message's latency
        (each fetch costs the broker; see `KafkaConfig.fetch_max_wait_ms`); None: the
        bus's default. A bus that pushes (the memory bus) ignores it."""
        ...

    def close(self) -> None: ...
