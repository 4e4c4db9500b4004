"""The shared consume loop on both transports: retries, dead letters, commits, SIGTERM."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from sluice.bus.base import EventBus, Record, TopicSpec
from sluice.bus.codec import decode_as, encode
from sluice.bus.messages import Message, Timings, UsageRecord
from sluice.bus.topics import Lane, dead_letter_topic
from sluice.consumers.loop import ConsumeLoop, LoopConfig, run_until_signalled
from tests.integration.bus.drain import Member
from tests.waiting import wait_until

SETTLE_S = 60.0


def usage(request_id: str) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        tenant_id="t",
        model="m",
        lane=Lane.STANDARD,
        prompt_tokens=3,
        completion_tokens=4,
        finish_reason="stop",
        timings=Timings(queued_ms=1, finished_ms=2),
    )


class Permanent(Exception):
    retryable = False


class Flaky:
    """Fails `flaky` twice, `broken` always (retryable), `invalid` permanently."""

    def __init__(self) -> None:
        self.handled: list[str] = []
        self.calls: dict[str, int] = {}

    def handle(self, message: Message, record: Record) -> None:
        assert isinstance(message, UsageRecord)
        rid = message.request_id
        self.calls[rid] = self.calls.get(rid, 0) + 1
        if rid == "flaky" and self.calls[rid] <= 2:
            raise ConnectionError("database blinked")
        if rid == "broken":
            raise ConnectionError("database gone")
        if rid == "invalid":
            raise Permanent("tenant does not exist")
        self.handled.append(rid)


def make_loop(bus: EventBus, group: str, topic: str, handler: Flaky) -> ConsumeLoop:
    return ConsumeLoop(
        bus,
        group,
        [topic],
        handler,
        config=LoopConfig(max_attempts=3, backoff_initial_s=0.01, poll_timeout_s=0.1),
        decoder=lambda r: decode_as(UsageRecord, r.value),
    )


def test_poison_and_failing_messages_are_dead_lettered_and_the_rest_committed(
    bus: EventBus, topic: str, group: str
) -> None:
    dlq = dead_letter_topic(topic)
    bus.create_topics([TopicSpec(topic, 2), TopicSpec(dlq, 1)])
    for rid in ["a", "flaky", "b", "broken", "invalid", "c"]:
        bus.publish(topic, encode(usage(rid)), key=b"tenant")
    bus.publish(topic, b"\x00not json", key=b"tenant")
    bus.publish(topic, encode(usage("d")), key=b"tenant")
    bus.flush()

    handler = Flaky()
    loop = make_loop(bus, group, topic, handler)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    wait_until(lambda: loop.stats.handled + loop.stats.dead_lettered == 8, SETTLE_S, "8 outcomes")
    loop.stop()
    thread.join(30)
    assert not thread.is_alive()

    assert handler.handled == ["a", "flaky", "b", "c", "d"]  # order kept, nothing lost
    assert handler.calls["flaky"] == 3
    assert handler.calls["broken"] == 3  # max_attempts
    assert handler.calls["invalid"] == 1  # permanent: no retry
    assert loop.stats.dead_lettered == 3
    assert loop.stats.retries == 4

    dead = Member(bus.consumer(group + "-dlq", [dlq])).start()
    wait_until(lambda: len(dead.records) == 3, SETTLE_S, "3 dead letters")
    dead.halt()
    reasons = {r.header("sluice-dlq-attempts"): r.header("sluice-dlq-reason") for r in dead.records}
    assert set(reasons) == {b"0", b"1", b"3"}
    assert reasons[b"0"] is not None and reasons[b"0"].startswith(b"decode:")
    assert reasons[b"1"] == b"Permanent: tenant does not exist"
    assert all(r.header("sluice-dlq-source") for r in dead.records)

    # Everything was committed: the group has nothing left to deliver.
    again = Member(bus.consumer(group, [topic])).start()
    wait_until(lambda: len(again.assigned) == 2, SETTLE_S, "rejoin")
    # a fence in each partition: anything left to deliver would come before it
    for partition in range(2):
        bus.publish(topic, b"fence", partition=partition).result(30)
    wait_until(lambda: len(again.records) >= 2, SETTLE_S, "both fences")
    again.halt()
    assert [r.value for r in again.records] == [b"fence", b"fence"]


@pytest.mark.slow
def test_sigterm_drains_commits_and_returns(bus: EventBus, topic: str, group: str) -> None:
    bus.create_topics([TopicSpec(topic, 1)])
    for n in range(20):
        bus.publish(topic, encode(usage(f"r{n}")), key=b"t")
    bus.flush()
    handler = Flaky()
    loop = make_loop(bus, group, topic, handler)

    def terminate_when_busy() -> None:
        wait_until(lambda: len(handler.handled) >= 5, SETTLE_S, "5 handled")
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_when_busy, daemon=True)
    killer.start()
    run_until_signalled(loop)  # returns only after the signal
    killer.join(5)
    handled = list(handler.handled)
    assert len(handled) >= 5
    # What the stopped member handled is committed; the next member gets only the rest.
    rest = Member(bus.consumer(group, [topic])).start()
    expected = 20 - len(handled)
    wait_until(lambda: len(rest.records) >= expected, SETTLE_S, f"{expected} remaining")
    # a fence in the partition: anything else left to deliver would come before it
    bus.publish(topic, b"fence", partition=0).result(30)
    wait_until(lambda: b"fence" in [r.value for r in rest.records], SETTLE_S, "the fence")
    rest.halt()
    assert rest.records[-1].value == b"fence"
    remaining = [decode_as(UsageRecord, r.value).request_id for r in rest.records[:-1]]
    assert handled + remaining == [f"r{n}" for n in range(20)]
