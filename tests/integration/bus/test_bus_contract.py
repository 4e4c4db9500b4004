"""The EventBus contract, run unchanged against the memory bus and a real Kafka broker."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from sluice.bus.base import EventBus, Record, TopicPartition, TopicSpec
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.tracing.propagation import extract_context, inject_headers
from tests.integration.bus.drain import Member
from tests.waiting import wait_until

SETTLE_S = 60.0  # Kafka group joins take seconds (docs/architecture.md §2); memory is instant


def test_topics_are_created_with_configured_partitions(bus: EventBus, topic: str) -> None:
    bus.create_topics([TopicSpec(topic, 3), TopicSpec(topic + ".other", 1)])
    assert bus.num_partitions(topic) == 3
    assert bus.num_partitions(topic + ".other") == 1
    bus.create_topics([TopicSpec(topic, 3)])  # idempotent
    assert bus.num_partitions(topic) == 3


def test_layout_lists_every_topic_with_a_dead_letter_twin() -> None:
    layout = TopicLayout(request_partitions=4, pools=("tiny-llama",))
    specs = {s.name: s.num_partitions for s in layout.specs(["other"])}
    assert specs["sluice.requests.tiny-llama.interactive.v1"] == 4
    assert specs["sluice.requests.other.standard.v1"] == 4
    assert specs["sluice.requests.tiny-llama.batch.v1.dlq"] == 1
    assert not [name for name in TopicLayout().specs() if "requests" in name.name]  # no pool
    assert {"sluice.tokens.v1", "sluice.usage.v1", "sluice.control.v1"} <= set(specs)


def test_publish_confirms_delivery_at_the_offset_consumers_see(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 2)])
    delivered = [bus.publish(topic, f"m{i}".encode(), key=b"k").result(30) for i in range(3)]
    assert len({d.partition for d in delivered}) == 1
    assert [d.offset for d in delivered] == [0, 1, 2]
    member = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: len(member.records) == 3, SETTLE_S, "3 records")
    member.halt()
    assert [(r.partition, r.offset, r.value) for r in member.records] == [
        (delivered[i].partition, i, f"m{i}".encode()) for i in range(3)
    ]


def test_messages_with_one_key_keep_their_order(bus: EventBus, topic: str, group: str) -> None:
    bus.create_topics([TopicSpec(topic, 4)])
    keys = [f"tenant-{i}".encode() for i in range(5)]
    for n in range(60):
        bus.publish(topic, str(n).encode(), key=keys[n % 5])
    bus.flush()
    member = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: len(member.records) == 60, SETTLE_S, "60 records")
    member.halt()
    by_key: dict[bytes, list[int]] = defaultdict(list)
    partitions: dict[bytes, set[int]] = defaultdict(set)
    for r in member.records:
        assert r.key is not None
        by_key[r.key].append(int(r.value))
        partitions[r.key].add(r.partition)
    for i, key in enumerate(keys):
        assert by_key[key] == list(range(i, 60, 5))
        assert len(partitions[key]) == 1


def _settled(members: list[Member], partitions: set[TopicPartition]) -> bool:
    assigned = [m.assigned for m in members]
    return (
        all(assigned)
        and set().union(*assigned) == partitions
        and sum(len(a) for a in assigned) == len(partitions)
    )


def test_group_members_share_partitions_and_each_message_reaches_one(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 4)])
    partitions = {TopicPartition(topic, p) for p in range(4)}
    a = Member(bus.consumer(group, [topic])).start()
    b = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: _settled([a, b], partitions), SETTLE_S, "two members to split 4 partitions")
    for p in range(4):
        for n in range(10):
            bus.publish(topic, f"{p}-{n}".encode(), partition=p)
    bus.flush()
    wait_until(lambda: len(a.records) + len(b.records) >= 40, SETTLE_S, "40 records")
    a.halt()
    b.halt()
    seen_a = {r.value for r in a.records}
    seen_b = {r.value for r in b.records}
    assert len(a.records) + len(b.records) == 40
    assert seen_a.isdisjoint(seen_b)
    assert len(seen_a) == 20 and len(seen_b) == 20


def test_uncommitted_messages_of_a_leaving_member_go_to_the_other(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 2)])
    partitions = {TopicPartition(topic, p) for p in range(2)}
    quitter = Member(bus.consumer(group, [topic]), commit=False).start()
    stayer = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: _settled([quitter, stayer], partitions), SETTLE_S, "two members")
    for p in range(2):
        for n in range(10):
            bus.publish(topic, f"{p}-{n}".encode(), partition=p)
    bus.flush()
    wait_until(lambda: len(quitter.records) == 10, SETTLE_S, "the quitter's 10 records")
    quitter.halt()  # closes without having committed anything
    everything = {f"{p}-{n}".encode() for p in range(2) for n in range(10)}
    wait_until(
        lambda: {r.value for r in stayer.records} == everything,
        SETTLE_S,
        "the quitter's records to be redelivered to the stayer",
    )
    stayer.halt()
    assert {r.value for r in quitter.records} <= {r.value for r in stayer.records}


def test_a_commit_that_does_not_wait_is_where_the_next_member_starts(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 1)])
    consumer = bus.consumer(group, [topic])
    wait_until(lambda: bool(consumer.assignment()) or bool(consumer.poll(0.1)), SETTLE_S, "join")
    for n in range(6):
        bus.publish(topic, f"m{n}".encode(), partition=0)
    bus.flush()
    got: list[Record] = []
    wait_until(lambda: len(got.__iadd__(consumer.poll(0.1))) >= 6, SETTLE_S, "6 records")
    consumer.commit({TopicPartition(topic, 0): 4}, wait=False)  # returns before the broker
    consumer.poll(0.2)  # the outcome is served inside a poll
    consumer.close()
    member = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: len(member.records) >= 2, SETTLE_S, "the 2 uncommitted records")
    # a fence in the same partition: whatever else came would come before it
    bus.publish(topic, b"fence", partition=0).result(30)
    wait_until(lambda: b"fence" in [r.value for r in member.records], SETTLE_S, "the fence")
    member.halt()
    assert [r.value for r in member.records] == [b"m4", b"m5", b"fence"]


def test_paused_partitions_deliver_nothing_until_resumed(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 2)])
    consumer = bus.consumer(group, [topic])
    wait_until(
        lambda: len(consumer.assignment()) == 2 or bool(consumer.poll(0.1)), SETTLE_S, "join"
    )
    held = TopicPartition(topic, 0)
    consumer.pause([held])
    assert consumer.paused() == {held}
    for p in range(2):
        for n in range(5):
            bus.publish(topic, f"{p}-{n}".encode(), partition=p)
    bus.flush()
    got = []
    wait_until(lambda: len(got) >= 5 or bool(got.extend(consumer.poll(0.1))), 30, "5 records")
    for _ in range(5):
        got.extend(consumer.poll(0.1))
    assert {r.partition for r in got} == {1}
    assert len(got) == 5
    consumer.resume([held])
    assert consumer.paused() == set()
    wait_until(lambda: len(got) >= 10 or bool(got.extend(consumer.poll(0.1))), 30, "10 records")
    assert sorted(r.value for r in got if r.partition == 0) == [f"0-{n}".encode() for n in range(5)]
    consumer.close()


def test_a_partition_paused_through_a_rebalance_is_paused_only_if_paused_says_so(
    bus: EventBus, topic: str, group: str
) -> None:
    """The engine worker trusts `paused()` to resume what it paused. librdkafka keeps a
    partition paused through a rebalance, even one that comes back to the same member;
    the adapter once reported it unpaused, so it was never resumed nor fetched again."""
    bus.create_topics([TopicSpec(topic, 1)])
    held = TopicPartition(topic, 0)
    revoked: list[set[TopicPartition]] = []
    consumer = bus.consumer(group, [topic], on_revoke=revoked.append)
    wait_until(lambda: bool(consumer.assignment()) or bool(consumer.poll(0.1)), SETTLE_S, "join")
    consumer.pause([held])
    other = Member(bus.consumer(group, [topic])).start()  # a rebalance, and another when
    deadline = time.monotonic() + 15  # it leaves: the partition comes back
    while not revoked and time.monotonic() < deadline:  # (the memory bus may keep it)
        consumer.poll(0.1)
    other.halt()
    wait_until(lambda: bool(consumer.poll(0.1)) or held in consumer.assignment(), SETTLE_S, "back")
    consumer.resume(sorted(consumer.paused()))
    for n in range(3):
        bus.publish(topic, f"m{n}".encode(), partition=0)
    bus.flush()
    got: list[Record] = []
    wait_until(lambda: len(got.__iadd__(consumer.poll(0.1))) >= 3, 30, "3 records")
    consumer.close()
    assert [r.value for r in got] == [b"m0", b"m1", b"m2"]


def test_a_partition_paused_with_records_in_line_delivers_them_after_resume(
    bus: EventBus, topic: str, group: str
) -> None:
    """The engine worker pauses lanes mid-stream. kafka-python 3.0.12 (the bus's earlier
    client) parked a paused partition's fetched records and, after resume, restored them
    only when its in-line slot was None, not an exhausted batch: the partition then
    stalled for good (the tail of a lane was never delivered at the end of a loaded
    `bench serving` run). Kept for any client."""
    bus.create_topics([TopicSpec(topic, 2)])
    consumer = bus.consumer(group, [topic])
    wait_until(
        lambda: len(consumer.assignment()) == 2 or bool(consumer.poll(0.1)), SETTLE_S, "join"
    )
    for p in range(2):
        for n in range(10):
            bus.publish(topic, f"{p}-{n}".encode(), partition=p)
    bus.flush()
    got: list[Record] = []
    wait_until(lambda: bool(got.extend(consumer.poll(0.1, max_records=3))) or bool(got), 30, "1")
    held = TopicPartition(topic, got[0].partition)
    consumer.pause([held])  # its other records are fetched and waiting in line
    other = 1 - held.partition
    wait_until(
        lambda: (
            sum(r.partition == other for r in got) >= 10
            or bool(got.extend(consumer.poll(0.1, max_records=3)))
        ),
        30,
        "the other partition",
    )
    for _ in range(3):
        got.extend(consumer.poll(0.1, max_records=3))  # nothing new: the in-line slot drains
    consumer.resume([held])
    wait_until(
        lambda: (
            sum(r.partition == held.partition for r in got) >= 10
            or bool(got.extend(consumer.poll(0.1, max_records=3)))
        ),
        15,
        "the resumed partition's records",
    )
    values = sorted(r.value for r in got if r.partition == held.partition)
    assert values == sorted(f"{held.partition}-{n}".encode() for n in range(10))
    consumer.close()


def test_headers_and_trace_context_round_trip(bus: EventBus, topic: str, group: str) -> None:
    bus.create_topics([TopicSpec(topic, 1)])
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("publish") as span:
        headers = inject_headers([("sluice-tenant", b"t-1"), ("bin", bytes([0, 255, 7]))])
        sent_trace_id = span.get_span_context().trace_id
    bus.publish(topic, b"v", key=b"k", headers=headers).result(30)
    member = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: len(member.records) == 1, SETTLE_S, "1 record")
    member.halt()
    record = member.records[0]
    assert record.headers == headers
    assert record.header("sluice-tenant") == b"t-1"
    received = trace.get_current_span(extract_context(record.headers)).get_span_context()
    assert received.trace_id == sent_trace_id


def test_rebalance_callbacks_run_on_the_polling_thread_and_revoke_can_commit(
    bus: EventBus, topic: str, group: str
) -> None:
    bus.create_topics([TopicSpec(topic, 2)])
    for n in range(4):
        bus.publish(topic, str(n).encode(), partition=n % 2)
    bus.flush()
    events: list[tuple[str, set[TopicPartition], str]] = []
    consumed: dict[TopicPartition, int] = {}
    holder: dict[str, object] = {}

    def on_assign(partitions: set[TopicPartition]) -> None:
        events.append(("assign", partitions, threading.current_thread().name))

    def on_revoke(partitions: set[TopicPartition]) -> None:
        events.append(("revoke", partitions, threading.current_thread().name))
        holder["consumer"].commit({tp: consumed[tp] for tp in partitions if tp in consumed})  # type: ignore[attr-defined]

    consumer = bus.consumer(group, [topic], on_assign=on_assign, on_revoke=on_revoke)
    holder["consumer"] = consumer
    got: list[Record] = []
    wait_until(lambda: len(got) >= 4 or bool(got.extend(consumer.poll(0.1))), SETTLE_S, "4 records")
    for record in got:
        consumed[record.tp] = record.offset + 1
    consumer.close()  # nothing committed yet except what on_revoke commits now
    me = threading.current_thread().name
    both = {TopicPartition(topic, 0), TopicPartition(topic, 1)}
    # A broker may assign in steps (metadata arriving late); what holds: every callback
    # ran on this thread, the last assignment was both partitions, close revoked both.
    assert {thread for _, _, thread in events} == {me}
    assert [p for kind, p, _ in events if kind == "assign"][-1] == both
    assert events[-1] == ("revoke", both, me)
    # The commit made inside on_revoke held: a new member has nothing left to read.
    bus.publish(topic, b"late", partition=0).result(30)
    late = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: len(late.records) >= 1, SETTLE_S, "the late record")
    # a fence in the same partition: whatever else came would come before it
    bus.publish(topic, b"fence", partition=0).result(30)
    wait_until(lambda: b"fence" in [r.value for r in late.records], SETTLE_S, "the fence")
    late.halt()
    assert [r.value for r in late.records] == [b"late", b"fence"]


def test_a_latest_consumer_sees_what_is_published_once_it_is_assigned(
    bus: EventBus, topic: str, group: str
) -> None:
    """The gateway reads its reply topic from 'latest' and sends requests as soon as it is
    assigned: a reply published right after must arrive (librdkafka resolved 'latest' in
    the background after the assignment, and skipped such a message)."""
    bus.create_topics([TopicSpec(topic, 1)])
    bus.publish(topic, b"old", key=b"k").result(30)
    consumer = bus.consumer(group, [topic], offset_reset="latest")
    got: list[bytes] = []
    try:
        deadline = time.monotonic() + SETTLE_S
        while not consumer.assignment() and time.monotonic() < deadline:
            got += [r.value for r in consumer.poll(0.05)]
        assert consumer.assignment(), "not assigned"
        bus.publish(topic, b"new", key=b"k").result(30)
        deadline = time.monotonic() + 10.0
        while b"new" not in got and time.monotonic() < deadline:
            got += [r.value for r in consumer.poll(0.1)]
    finally:
        consumer.close()
    assert b"new" in got


def test_publishers_that_stop_waiting_do_not_stop_later_deliveries(
    bus: EventBus, topic: str
) -> None:
    """A publish whose waiter timed out (its future cancelled) before the broker answered:
    the deliveries after it are still confirmed."""
    bus.create_topics([TopicSpec(topic, 1)])
    futures = [bus.publish(topic, b"given up", key=b"k") for _ in range(200)]
    cancelled = sum(f.cancel() for f in futures)
    later = bus.publish(topic, b"waited for", key=b"k")
    assert later.result(timeout=15).topic == topic
    if not isinstance(bus, MemoryEventBus):  # Kafka answers later: most were given up on
        assert cancelled > 0
