"""Reply coalescing: mid-stream deltas wait for the interval; first and last ones do not.

The interval runs on `FakeClockLoop`'s clock, which moves only when a test advances it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluice.bus.base import TopicPartition
from sluice.bus.codec import decode_as, encode
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import TokenDeltaBatch
from sluice.bus.topics import reply_topic
from sluice.consumers.engine_publisher import StepPublisher
from sluice.consumers.progress import MemoryProgressStore, StepProgress
from sluice.consumers.work_item import WorkItem
from sluice.engine.backends.base import EngineDelta
from tests.unit.consumers.engine_harness import GATEWAY, create_topics, make_request


class RecordingStore(MemoryProgressStore):
    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[int] = []  # token ids, in the order progress was recorded

    def record(self, steps: Sequence[StepProgress]) -> set[str]:
        self.recorded += [t for s in steps for t in s.token_ids]
        return super().record(steps)


def _item(store: MemoryProgressStore, request_id: str) -> WorkItem:
    item = WorkItem(make_request(request_id), TopicPartition("t", 0), 0, None, 0)
    item.start()
    item.begin(store.begin_attempts([(request_id, 0)])[0])
    item.run()
    return item


class FakeClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` (what `call_at` timers and the publisher read) moves
    only by `advance`: a timer fires on the first loop turn after its time is passed."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def advance_to(self, now: float) -> None:
        assert now >= self.now
        self.now = now


async def _scenario(interval_s: float) -> tuple[list[list[list[int]]], RecordingStore, list[str]]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, FakeClockLoop)
    bus = MemoryEventBus()
    create_topics(bus, 1)
    replies = bus.consumer("gw", [reply_topic(GATEWAY)])
    store, finished = RecordingStore(), []
    io = ThreadPoolExecutor(1)
    confirmed = asyncio.Event()  # set by each confirmed step (the publisher's callback)

    def on_confirmed(done: list[WorkItem], _fenced: set[str]) -> None:
        finished.extend(i.request_id for i in done)
        confirmed.set()

    async def next_confirmed_step() -> None:
        await confirmed.wait()
        confirmed.clear()

    publisher = StepPublisher(bus, store, io, "w1", on_confirmed, reply_interval_s=interval_s)
    publisher.bind(loop)
    a, b = _item(store, "a"), _item(store, "b")
    messages: list[list[list[int]]] = []

    def read() -> None:
        for record in replies.poll(0.0):
            batch = decode_as(TokenDeltaBatch, record.value)
            messages.append([d.token_ids for d in batch.deltas])

    publisher.publish_step([(a, EngineDelta("a", [1], "x")), (b, EngineDelta("b", [11], "y"))])
    for n in range(2, 5):  # three quick mid-stream steps, 2 ms apart
        loop.advance_to((n - 1) * 0.002)
        publisher.publish_step(
            [(a, EngineDelta("a", [n], "x")), (b, EngineDelta("b", [10 + n], "y"))]
        )
    await next_confirmed_step()  # the first one; the others are held, not queued
    read()
    held_progress = list(store.recorded)
    due = 0.002 + interval_s  # the interval from the first held step
    loop.advance_to(due - 0.001)
    for _ in range(3):  # loop turns, where a due timer would fire (it publishes at once)
        await asyncio.sleep(0)
    read()
    assert len(messages) == 1, "held deltas went out before their interval"
    loop.advance_to(due)  # the timer sends what is held
    await next_confirmed_step()
    read()
    publisher.publish_step([(a, EngineDelta("a", [5], "x", finish_reason="length"))])
    assert await publisher.flush(5.0)
    read()
    publisher.close()
    io.shutdown()
    assert held_progress == [1, 11], "progress of held deltas was recorded before sending"
    return messages, store, finished


@pytest.mark.timeout(30)  # the fake clock never ends a wait: a timer that does not fire hangs
def test_mid_stream_deltas_wait_for_the_interval_first_and_last_go_at_once() -> None:
    with asyncio.Runner(loop_factory=FakeClockLoop) as runner:
        messages, store, finished = runner.run(_scenario(0.1))
    assert messages == [
        [[1], [11]],  # first tokens: at once
        [[2, 3, 4], [12, 13, 14]],  # three steps held, sent by the timer, one delta each
        [[5]],  # the terminal delta: at once
    ]
    assert store.recorded == [1, 11, 2, 12, 3, 13, 4, 14, 5]
    assert finished == ["a"]


def test_an_interval_of_zero_sends_every_step() -> None:
    async def run() -> int:
        bus = MemoryEventBus()
        create_topics(bus, 1)
        replies = bus.consumer("gw", [reply_topic(GATEWAY)])
        store = MemoryProgressStore()
        publisher = StepPublisher(bus, store, ThreadPoolExecutor(1), "w1", lambda *_: None)
        publisher.bind(asyncio.get_running_loop())
        item = _item(store, "a")
        for n in range(4):
            publisher.publish_step([(item, EngineDelta("a", [n], "x"))])
        assert await publisher.flush(5.0)
        publisher.close()
        return len(replies.poll(0.0))

    assert asyncio.run(run()) == 4


def test_a_requests_held_parts_go_out_as_one_delta_with_the_last_seq_no_and_ending() -> None:
    from sluice.bus.messages import Usage
    from sluice.consumers.engine_outputs import build_step, render
    from sluice.engine.backends.base import EngineLogprob

    store = MemoryProgressStore()
    a, b = _item(store, "a"), _item(store, "b")
    for item in (a, b):  # earlier messages took them to seq_no 3 at offset 10
        item.seq_no, item.token_offset, item.text_offset = 3, 10, 10

    def lp(*tokens: int) -> list[EngineLogprob]:
        return [EngineLogprob(t, -0.5, [(t, -0.5)]) for t in tokens]

    prompt_lp = [None, EngineLogprob(9, -1.5, [(3, -0.25)], rank=4)]
    steps = [
        [
            (a, EngineDelta("a", [1, 2], "ab", logprobs=lp(1, 2), prompt_logprobs=prompt_lp)),
            (b, EngineDelta("b", [5], "e")),
        ],
        [
            (a, EngineDelta("a", [3, 4], "cd", logprobs=lp(3, 4))),
            (b, EngineDelta("b", [6], "f", finish_reason="stop", num_cached_tokens=0)),
        ],
    ]
    parts = [p for pairs in steps for p in build_step(pairs, "w1").batches[GATEWAY]]
    assert len(parts) == 4
    merged_a, merged_b = render(parts)
    assert (merged_a.request_id, merged_a.seq_no, merged_a.token_offset) == ("a", 4, 10)
    assert (merged_a.token_ids, merged_a.text, merged_a.finish_reason) == (
        [1, 2, 3, 4],
        "abcd",
        None,
    )
    assert [x.token_id for x in merged_a.logprobs or []] == [1, 2, 3, 4]
    assert [x.top[0].token_id for x in merged_a.logprobs or []] == [1, 2, 3, 4]
    assert merged_a.prompt_logprobs is not None and merged_a.prompt_logprobs[0] is None
    pl = merged_a.prompt_logprobs[1]
    assert pl is not None and (pl.token_id, pl.logprob, pl.rank) == (9, -1.5, 4)
    assert [(t.token_id, t.logprob) for t in pl.top] == [(3, -0.25)]
    assert merged_b.prompt_logprobs is None
    assert (merged_b.request_id, merged_b.seq_no, merged_b.token_offset, merged_b.text_offset) == (
        "b",
        4,
        10,
        10,
    )
    assert (merged_b.token_ids, merged_b.text, merged_b.logprobs) == ([5, 6], "ef", None)
    prompt = len(b.request.prompt_token_ids)
    assert merged_b.finish_reason == "stop"
    assert merged_b.usage == Usage(prompt_tokens=prompt, cached_tokens=0, completion_tokens=12)
    # it encodes and decodes like any batch
    deltas = [merged_a, merged_b]
    batch = decode_as(TokenDeltaBatch, encode(TokenDeltaBatch(reply_to="g", deltas=deltas)))
    assert batch.deltas == deltas


def test_a_finished_attempts_usage_goes_out_after_its_finish_is_recorded() -> None:
    """A worker killed between the two leaves the finish recorded and no usage record, which
    the resumer estimates from the progress store; the other order left a record and no
    finish, and the resumer ran the finished request again, billing it twice."""
    from sluice.bus.messages import UsageRecord
    from sluice.bus.topics import USAGE_TOPIC

    bus = MemoryEventBus()
    create_topics(bus, 1)
    usage = bus.consumer("billing", [USAGE_TOPIC])
    seen_at_record: list[int] = []

    class Store(MemoryProgressStore):
        def record(self, steps: Sequence[StepProgress]) -> set[str]:
            if any(s.finished for s in steps):
                seen_at_record.append(len(usage.poll(0.05, 100)))
            return super().record(steps)

    async def run() -> list[UsageRecord]:
        store, done = Store(), asyncio.Event()
        publisher = StepPublisher(
            bus, store, ThreadPoolExecutor(1), "w1", lambda *_: done.set(), reply_interval_s=0
        )
        publisher.bind(asyncio.get_running_loop())
        item = _item(store, "f")
        end = EngineDelta("f", [7], "x", finish_reason="length", num_prompt_tokens=4,
                          num_cached_tokens=0, num_output_tokens=1)  # fmt: skip
        publisher.publish_step([(item, end)])
        await asyncio.wait_for(done.wait(), 5)
        publisher.close()
        return [decode_as(UsageRecord, r.value) for r in usage.poll(0.05, 100)]

    records = asyncio.run(run())
    assert seen_at_record == [0]  # nothing billed yet when the finish was recorded
    assert [(u.request_id, u.prompt_tokens, u.completion_tokens) for u in records] == [("f", 4, 1)]
