"""MemoryEventBus retention: memory stays bounded while every group still reads what it may.

The bus keeps each partition's newest `retention_records`; older records stay only while
some group may read them again (a live member's position, a committed offset, or the
whole log for an 'earliest' group that never committed).
"""

from __future__ import annotations

from sluice.bus.base import Record, TopicPartition, TopicSpec
from sluice.bus.memory import MemoryConsumer, MemoryEventBus

WINDOW = 8
TOPIC = "t.v1"
TP0 = TopicPartition(TOPIC, 0)


def _bus(partitions: int = 1) -> MemoryEventBus:
    bus = MemoryEventBus(retention_records=WINDOW)
    bus.create_topics([TopicSpec(TOPIC, partitions)])
    return bus


def _publish(bus: MemoryEventBus, n: int, partition: int = 0) -> None:
    for i in range(n):
        bus.publish(TOPIC, f"m{i}".encode(), partition=partition).result(1)


def _drain(consumer: MemoryConsumer, max_records: int = 500) -> list[Record]:
    out: list[Record] = []
    while batch := consumer.poll(0.0, max_records):
        out += batch
    return out


def _commit_all(consumer: MemoryConsumer, records: list[Record]) -> None:
    offsets: dict[TopicPartition, int] = {}
    for r in records:
        offsets[r.tp] = r.offset + 1
    if offsets:
        consumer.commit(offsets)


def test_retained_records_stay_bounded_over_many_publish_consume_commit_cycles() -> None:
    bus = _bus(partitions=2)
    worker = bus.consumer("engine", [TOPIC])
    replies = bus.consumer("gateway-1", [TOPIC], offset_reset="latest")
    worker.poll(0.0)
    replies.poll(0.0)
    num_worked = num_replied = 0
    for cycle in range(500):
        for p in range(2):
            _publish(bus, 3, partition=p)
        records = _drain(worker)
        _commit_all(worker, records)
        num_worked += len(records)
        num_replied += len(_drain(replies))
        assert bus.num_retained() <= 2 * WINDOW, f"cycle {cycle}"
    assert num_worked == num_replied == 500 * 6
    # offsets stay absolute: the log starts late but counts from the first record ever
    assert bus.end_offset(TP0) == 1500
    assert bus.start_offset(TP0) == 1500 - WINDOW


def test_a_group_keeps_what_it_has_not_read_or_committed() -> None:
    bus = _bus()
    fast = bus.consumer("fast", [TOPIC])
    slow = bus.consumer("slow", [TOPIC])
    fast.poll(0.0)
    slow.poll(0.0)
    _publish(bus, 100)
    first = slow.poll(0.0, max_records=10)
    slow.commit({TP0: first[-1].offset + 1})
    _commit_all(fast, _drain(fast))
    assert bus.num_retained() == 90  # what `slow` has not committed yet
    rest = _drain(slow)
    assert [r.offset for r in rest] == list(range(10, 100))
    _commit_all(slow, rest)
    assert bus.num_retained() == WINDOW


def test_uncommitted_records_are_redelivered_at_absolute_offsets_after_trimming() -> None:
    bus = _bus()
    quitter = bus.consumer("g", [TOPIC])
    quitter.poll(0.0)
    _publish(bus, 50)
    _commit_all(quitter, _drain(quitter))  # 0..49 done: all but the window may go
    _publish(bus, 30)
    assert [r.offset for r in _drain(quitter)] == list(range(50, 80))
    quitter.close()  # leaves without committing 50..79
    stayer = bus.consumer("g", [TOPIC])
    assert [r.offset for r in _drain(stayer)] == list(range(50, 80))


def test_a_group_with_commits_and_no_members_resumes_where_it_committed() -> None:
    """An engine worker that stopped: its group's commit pins the log until it returns."""
    bus = _bus()
    engine = bus.consumer("engine", [TOPIC])
    engine.poll(0.0)
    _publish(bus, 5)
    _commit_all(engine, _drain(engine))
    engine.close()
    _publish(bus, 3 * WINDOW)
    restarted = bus.consumer("engine", [TOPIC])
    assert [r.offset for r in _drain(restarted)] == list(range(5, 5 + 3 * WINDOW))


def test_an_earliest_group_that_never_commits_keeps_the_whole_log() -> None:
    bus = _bus()
    reader = bus.consumer("g", [TOPIC])
    reader.poll(0.0)
    _publish(bus, 3 * WINDOW)
    _drain(reader)
    # a rebalance would send the group back to the log's start: nothing may go yet
    assert bus.num_retained() == 3 * WINDOW


def test_closed_reply_groups_pin_nothing() -> None:
    """The gateway reads its reply topic from 'latest' with a fresh group per instance and
    never commits; a closed instance's group must not hold records forever."""
    bus = _bus()
    for instance in range(20):
        replies = bus.consumer(f"gateway-{instance}", [TOPIC], offset_reset="latest")
        replies.poll(0.0)
        _publish(bus, 40)
        assert len(_drain(replies)) == 40
        assert bus.num_retained() <= WINDOW
        replies.close()
    _publish(bus, 40)  # deltas that arrive after the last gateway left
    assert bus.num_retained() == WINDOW
    assert bus._groups == {}


def test_a_late_group_replays_the_retained_window() -> None:
    bus = _bus()
    _publish(bus, 3 * WINDOW)  # nobody reads this topic: only the newest stay
    assert bus.num_retained() == WINDOW
    late = bus.consumer("late", [TOPIC])
    got = _drain(late)
    assert [r.offset for r in got] == list(range(2 * WINDOW, 3 * WINDOW))
    assert bus.start_offset(TP0) == 2 * WINDOW


def test_a_commit_below_the_log_start_resumes_at_the_start() -> None:
    bus = _bus()
    _publish(bus, 3 * WINDOW)
    consumer = bus.consumer("g", [TOPIC])
    consumer.poll(0.0, max_records=1)
    consumer.commit({TP0: 0})  # older than anything retained
    consumer.close()
    again = bus.consumer("g", [TOPIC])
    assert [r.offset for r in _drain(again)] == list(range(2 * WINDOW, 3 * WINDOW))


def test_an_empty_group_stops_pinning_once_its_commits_expire() -> None:
    """Kafka's offsets.retention: a group nobody rejoins (a closed gateway's reply group,
    which commits where it read) must not hold its topic for good."""
    now = [0.0]
    bus = MemoryEventBus(
        retention_records=WINDOW, empty_group_retention_s=60.0, clock=lambda: now[0]
    )
    replies = bus.consumer("gateway-1", [TOPIC], offset_reset="latest")
    replies.poll(0.0)
    _publish(bus, 5)
    _commit_all(replies, _drain(replies))
    replies.close()
    _publish(bus, 3 * WINDOW)  # late deltas: kept while the group may come back
    assert bus.num_retained() == 3 * WINDOW
    now[0] = 59.0
    _publish(bus, 1)
    assert bus.num_retained() == 3 * WINDOW + 1
    now[0] = 61.0
    _publish(bus, 1)
    assert bus.num_retained() == WINDOW
    assert bus._groups == {}


def test_large_records_are_retained_by_bytes_and_a_reading_group_loses_none() -> None:
    bus = MemoryEventBus(retention_records=WINDOW, retention_bytes=3000)
    bus.create_topics([TopicSpec(TOPIC, 1)])
    reader = bus.consumer("engine", [TOPIC])
    reader.poll(0.0)
    for i in range(20):
        bus.publish(TOPIC, bytes([i]) * 1000, partition=0).result(1)
    # the reader has committed nothing: every record stays for it
    records = _drain(reader)
    assert [r.value[0] for r in records] == list(range(20))
    assert bus.num_retained() == 20
    _commit_all(reader, records)
    bus.publish(TOPIC, b"x" * 1000, partition=0).result(1)
    assert bus.num_retained() == 3  # the newest 3000 bytes, not the newest WINDOW records
    late = bus.consumer("late", [TOPIC])
    assert [r.offset for r in _drain(late)] == [18, 19, 20]
