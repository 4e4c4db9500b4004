"""GatewayService on the memory bus: publish, route deltas, fence, dedupe, cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sluice.api import generation as api_generation
from sluice.api.generation import Generation, StreamEvent, Track
from sluice.api.service import GatewayService
from sluice.bus.base import TopicSpec
from sluice.bus.codec import decode_as, encode
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import (
    Cancel,
    GenerateRequest,
    Heartbeat,
    TokenDelta,
    TokenDeltaBatch,
    Usage,
)
from sluice.bus.topics import CONTROL_TOPIC, HEARTBEATS_TOPIC, Lane, reply_topic, request_topic


def delta(attempt: int, seq_no: int, offset: int, text: str, **kw: object) -> TokenDelta:
    return TokenDelta(
        request_id="req_1",
        attempt=attempt,
        seq_no=seq_no,
        token_offset=offset,
        text_offset=offset,
        token_ids=list(text.encode()),
        text=text,
        **kw,  # type: ignore[arg-type]
    )


def request(lane: Lane = Lane.STANDARD) -> GenerateRequest:
    return GenerateRequest(
        request_id="req_1",
        tenant_id="t1",
        model="tiny",
        lane=lane,
        prompt_token_ids=[1, 2],
        reply_to="gw1",
        created_ms=0,
    )


async def _started(bus: MemoryEventBus) -> GatewayService:
    service = GatewayService(bus, gateway_id="gw1", poll_timeout_s=0.01)
    await service.start()
    assert service.ready
    return service


def test_publishes_keyed_by_tenant_with_trace_headers() -> None:
    async def main() -> None:
        bus = MemoryEventBus()
        consumer = bus.consumer("probe", [request_topic(Lane.BATCH, "tiny")])
        service = await _started(bus)
        await service.submit([request(Lane.BATCH)], deadline_ms=None)
        [record] = consumer.poll(1.0)
        assert record.key == b"t1"
        assert decode_as(GenerateRequest, record.value) == request(Lane.BATCH)
        await service.stop()

    asyncio.run(main())


def test_fencing_and_dedupe_across_a_failover() -> None:
    """Attempt 0 delivers "Hel"; attempt 1 resumes at token 2 (overlapping "l"); attempt
    0's late deltas and a redelivered batch are dropped: the client sees each token once."""

    async def main() -> None:
        bus = MemoryEventBus()
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        script = [
            delta(0, 0, 0, "Hel"),
            delta(0, 0, 0, "Hel"),  # redelivered (at-least-once)
            delta(1, 0, 2, "llo"),  # failover: resumes from what attempt 0 published
            delta(0, 1, 3, "XX"),  # zombie attempt 0: fenced
            delta(1, 1, 5, " wor"),
            delta(1, 1, 5, " wor"),  # duplicate seq_no
            delta(
                1,
                2,
                9,
                "ld",
                finish_reason="stop",
                usage=Usage(prompt_tokens=2, completion_tokens=9, cached_tokens=1),
            ),
            delta(0, 2, 5, "YY", finish_reason="abort"),  # after the end: ignored
        ]
        for d in script:
            batch = TokenDeltaBatch(reply_to="gw1", deltas=[d])
            bus.publish(reply_topic("gw1"), encode(batch))
        [result] = await generation.collect()
        assert result.text == "Hello world"
        assert bytes(result.token_ids).decode() == "Hello world"
        assert result.finish_reason == "stop"
        assert generation.num_completion_tokens == 11
        assert generation.num_cached_tokens == 1
        assert service.num_live_requests == 0
        await service.stop()

    asyncio.run(main())


def test_a_delta_overtaken_by_the_next_one_is_taken_in_order() -> None:
    """A publish the worker had to retry lands after the next step's: the later delta
    waits for it, so the client gets every token once, in order (it used to get a gap:
    the late delta, below the last seq_no taken, was dropped as redelivered)."""

    async def main() -> None:
        bus = MemoryEventBus()
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        for d in [
            delta(0, 0, 0, "He"),
            delta(0, 2, 4, "o w"),  # overtook seq 1
            delta(0, 3, 7, "orld", finish_reason="length"),  # the end, held too
            delta(0, 1, 2, "ll"),  # late: fills the gap, then the held ones go out
            delta(0, 1, 2, "ll"),  # redelivered after the gap closed: dropped
        ]:
            bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[d])))
        events = []
        while generation.pending:
            event = await generation.next_event(1.0)
            assert event is not None
            events.append((event.text, event.finish_reason))
        assert events == [("He", None), ("ll", None), ("o w", None), ("orld", "length")]
        assert generation.num_completion_tokens == 11
        await service.stop()

    asyncio.run(main())


def test_a_gap_no_delta_fills_goes_out_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta that never comes (its worker died without a successor yet) holds the rest
    back for `GAP_WAIT_S`, then they go out with the gap rather than never."""
    monkeypatch.setattr(api_generation, "GAP_WAIT_S", 0.2)

    async def main() -> None:
        bus = MemoryEventBus()
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        for d in [delta(0, 0, 0, "ab"), delta(0, 2, 4, "ef", finish_reason="length")]:
            bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[d])))
        events = []
        while generation.pending:
            event = await generation.next_event(5.0)  # a long keep-alive: the gap is shorter
            assert event is not None
            events.append((event.text, event.finish_reason))
        assert events == [("ab", None), ("ef", "length")]
        await service.stop()

    asyncio.run(main())


def test_the_same_attempt_run_again_from_the_start_fills_in_what_is_missing() -> None:
    """A worker that takes a partition over with no shared progress store runs the
    request again as the same attempt, seq_no from 0: what it brings past the client's
    tokens is taken, the rest dropped (its seq_nos are all at or below the last taken)."""

    async def main() -> None:
        bus = MemoryEventBus()
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        for d in [
            delta(0, 0, 0, "Hel"),
            delta(0, 1, 3, "lo w"),  # the first worker got this far
            delta(0, 0, 0, "He"),  # the next one, from the start
            delta(0, 1, 2, "llo wo", finish_reason="length"),
        ]:
            bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[d])))
        [result] = await generation.collect()
        assert result.text == "Hello wo" and result.finish_reason == "length"
        await service.stop()

    asyncio.run(main())


def test_a_failover_drops_what_its_dead_attempt_held() -> None:
    async def main() -> None:
        bus = MemoryEventBus()
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        for d in [
            delta(0, 0, 0, "ab"),
            delta(0, 2, 4, "ZZ"),  # ahead of a delta that died with its worker
            delta(1, 0, 2, "cdef", finish_reason="length"),  # attempt 1 resumes at 2
        ]:
            bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[d])))
        [result] = await generation.collect()
        assert result.text == "abcdef" and result.finish_reason == "length"
        await service.stop()

    asyncio.run(main())


def test_resumed_attempt_entirely_behind_the_client_is_dropped() -> None:
    async def main() -> None:
        bus = MemoryEventBus()
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        for d in [
            delta(0, 0, 0, "abc"),
            delta(2, 0, 0, "ab"),  # attempt 2 re-sends tokens the client has: nothing new
            delta(2, 1, 2, "cd", finish_reason="length"),
        ]:
            bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[d])))
        events = []
        while generation.pending:
            event = await generation.next_event(1.0)
            assert event is not None
            events.append(event.text)
        assert events == ["abc", "d"]
        await service.stop()

    asyncio.run(main())


def test_cancel_and_deadline() -> None:
    async def main() -> None:
        bus = MemoryEventBus()
        control = bus.consumer("probe", [CONTROL_TOPIC])
        service = await _started(bus)
        service.deadline_grace_s = 0.0
        generation = await service.submit([request()], deadline_ms=0)  # long past
        event = await generation.next_event(5.0)
        assert event is not None and event.finish_reason == "deadline"
        [record] = control.poll(1.0)
        cancel = decode_as(Cancel, record.value)
        assert (cancel.request_id, cancel.tenant_id, cancel.reason) == ("req_1", "t1", "deadline")
        assert record.key == b"t1"
        assert not generation.pending
        await service.stop()

    asyncio.run(main())


def test_stop_ends_and_cancels_live_requests() -> None:
    async def main() -> None:
        bus = MemoryEventBus()
        control = bus.consumer("probe", [CONTROL_TOPIC])
        service = await _started(bus)
        generation = await service.submit([request()], deadline_ms=None)
        await service.stop()
        event = await generation.next_event(1.0)
        assert event is not None and event.finish_reason == "error"
        assert not generation.pending
        [record] = control.poll(1.0)
        assert decode_as(Cancel, record.value).reason == "gateway shutting down"

    asyncio.run(main())


def test_a_stream_cancelled_as_its_event_arrives_stays_cancelled() -> None:
    """asyncio.wait_for (3.11) returned the event and dropped the cancel in this race, so a
    cancelled stream went on waiting for its next event (up to the keep-alive wait)."""

    async def scenario() -> None:
        service: Any = object()  # next_event never calls the service without a deadline
        generation = Generation([Track(0, "r1")], tenant_id="t", wait_until=None, service=service)
        reader = asyncio.create_task(generation.next_event(120.0))
        await asyncio.sleep(0)  # the reader waits for an event
        generation._put(StreamEvent(0, text="x"))  # the event arrives...
        reader.cancel()  # ...as the reader is cancelled
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(reader, 1.0)
        event = await generation.next_event(1.0)  # the event stays for the next read
        assert event is not None and event.text == "x"

    asyncio.run(scenario())


def test_a_wait_ends_quietly_at_its_own_time_whatever_an_earlier_wait_armed() -> None:
    """One timer serves a generation's waits: a wait longer than the one that armed it
    must not end at the earlier time, and a shorter one must not outlast its own."""

    async def scenario() -> None:
        service: Any = object()
        generation = Generation([Track(0, "r1")], tenant_id="t", wait_until=None, service=service)
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(generation.next_event(0.05))
        await asyncio.sleep(0)
        generation._put(StreamEvent(0, text="x"))
        assert (await reader) == StreamEvent(0, text="x")
        start = loop.time()
        assert await generation.next_event(0.2) is None  # outlives the 0.05 s timer
        assert loop.time() - start >= 0.2 - 0.002
        reader = asyncio.create_task(generation.next_event(60.0))  # arms it for 60 s
        await asyncio.sleep(0)
        generation._put(StreamEvent(0, text="y"))
        assert (await reader) == StreamEvent(0, text="y")
        assert await asyncio.wait_for(generation.next_event(0.01), 1.0) is None

    asyncio.run(scenario())


def test_a_stream_taken_over_reads_the_other_gateways_replies_from_the_first() -> None:
    """gw1 died after its request's first deltas; gw2 adopts it: nothing is published,
    every delta comes from gw1's reply topic, earlier ones included, and gw2's
    heartbeats name the request it follows."""

    async def main() -> None:
        bus = MemoryEventBus()
        requests = bus.consumer("probe-requests", [request_topic(Lane.STANDARD, "tiny")])
        beats = bus.consumer("probe-beats", [HEARTBEATS_TOPIC])
        bus.create_topics([TopicSpec(reply_topic("gw1"))])
        for d in [delta(0, 0, 0, "Hel"), delta(0, 1, 3, "lo")]:
            bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[d])))
        gw2 = GatewayService(bus, gateway_id="gw2", poll_timeout_s=0.01, heartbeat_s=0.05)
        await gw2.start()
        generation = gw2.adopt("gw1", [request()], deadline_ms=None)
        last = delta(0, 2, 5, " world", finish_reason="length")
        bus.publish(reply_topic("gw1"), encode(TokenDeltaBatch(reply_to="gw1", deltas=[last])))
        [result] = await generation.collect()
        assert result.text == "Hello world"
        assert result.finish_reason == "length"
        assert not requests.poll(0.01)  # nothing published again
        heard = [decode_as(Heartbeat, r.value) for r in beats.poll(0.01)]
        assert ("gw2", ["req_1"]) in [(b.sender_id, b.follows) for b in heard]
        await gw2.stop()

    asyncio.run(main())


def test_a_cancel_no_worker_answered_is_sent_again_until_a_terminal() -> None:
    """A request waiting in the topics of a pool with no worker: its cancel reaches a
    worker that starts later (its control consumer reads from its start), because the
    gateway sends it again with each heartbeat until a terminal delta comes."""

    async def main() -> None:
        bus = MemoryEventBus()
        service = GatewayService(bus, gateway_id="gw1", poll_timeout_s=0.01, heartbeat_s=0.02)
        await service.start()
        generation = await service.submit([request()], deadline_ms=None)
        service.cancel(generation)
        await asyncio.sleep(0.1)
        late = bus.consumer("late-worker", [CONTROL_TOPIC], offset_reset="latest")
        late.poll(0.05)  # its position resolves: only what is published from now on
        await asyncio.sleep(0.2)
        again = [decode_as(Cancel, r.value) for r in late.poll(0.1, 100)]
        assert again and {c.request_id for c in again} == {"req_1"}
        terminal = delta(0, 0, 0, "", finish_reason="abort")
        batch = TokenDeltaBatch(reply_to="gw1", deltas=[terminal])
        bus.publish(reply_topic("gw1"), encode(batch))
        await asyncio.sleep(0.2)
        late.poll(0.05, 100)  # what was on its way as the terminal came
        await asyncio.sleep(0.2)
        assert late.poll(0.1, 100) == []
        await service.stop()

    asyncio.run(main())
