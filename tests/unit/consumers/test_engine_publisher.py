"""Reply coalescing: mid-stream deltas wait for the interval; first and last ones do not."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from bus.base import TopicPartition
from bus.codec import decode_as, encode
from bus.memory import MemoryEventBus
from bus.messages import TokenDeltaBatch
from bus.topics import reply_topic
from consumers.engine_outputs import ItemState, WorkItem
from consumers.engine_publisher import StepPublisher
from consumers.progress import MemoryProgressStore, StepProgress
from engine.backends.base import EngineDelta
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
    item.begin(store.begin_attempts([(request_id, 0)])[0])
    item.state = ItemState.RUNNING
    return item


async def _scenario(interval_s: float) -> tuple[list[list[list[int]]], RecordingStore, list[str]]:
    bus = MemoryEventBus()
    create_topics(bus, 1)
    replies = bus.consumer("gw", [reply_topic(GATEWAY)])
    store, finished = RecordingStore(), []
    io = ThreadPoolExecutor(1)
    publisher = StepPublisher(
        bus,
        store,
        io,
        "w1",
        lambda done, _fenced: finished.extend(i.request_id for i in done),
        reply_interval_s=interval_s,
    )
    publisher.bind(asyncio.get_running_loop())
    a, b = _item(store, "a"), _item(store, "b")
    messages: list[list[list[int]]] = []

    def read() -> None:
        for record in replies.poll(0.0):
            batch = decode_as(TokenDeltaBatch, record.value)
            messages.append([d.token_ids for d in batch.deltas])

    publisher.publish_step([(a, EngineDelta("a", [1], "x")), (b, EngineDelta("b", [11], "y"))])
    for n in range(2, 5):  # three quick mid-stream steps
        await asyncio.sleep(0.002)
        publisher.publish_step(
            [(a, EngineDelta("a", [n], "x")), (b, EngineDelta("b", [10 + n], "y"))]
        )
    await asyncio.sleep(0.01)
    read()
    held_progress = list(store.recorded)
    await asyncio.sleep(interval_s + 0.05)  # the timer sends what is held
    read()
    publisher.publish_step([(a, EngineDelta("a", [5], "x", finish_reason="length"))])
    assert await publisher.flush(5.0)
    read()
    publisher.close()
    io.shutdown()
    assert held_progress == [1, 11], "progress of held deltas was recorded before sending"
    return messages, store, finished


def test_mid_stream_deltas_wait_for_the_interval_first_and_last_go_at_once() -> None:
    messages, store, finished = asyncio.run(_scenario(0.1))
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


def test_a_requests_held_deltas_go_out_as_one_with_the_last_seq_no_and_ending() -> None:
    from bus.messages import TokenDelta, TokenLogprob, Usage
    from consumers.engine_outputs import merge_deltas

    def delta(rid: str, seq: int, tokens: list[int], **kw: object) -> TokenDelta:
        start = 10 + 2 * seq
        return TokenDelta(
            request_id=rid,
            attempt=1,
            seq_no=seq,
            token_offset=start,
            text_offset=start,
            token_ids=tokens,
            text="".join(chr(96 + t) for t in tokens),
            **kw,  # type: ignore[arg-type]
        )

    def lp(t: int) -> list[TokenLogprob]:
        return [TokenLogprob(token_id=t, logprob=-0.5)]

    usage = Usage(prompt_tokens=3, completion_tokens=16)
    held = [
        delta("a", 3, [1, 2], logprobs=lp(1) + lp(2)),
        delta("b", 7, [5, 6]),
        delta("a", 4, [3, 4], logprobs=lp(3) + lp(4)),
        delta("b", 8, [], finish_reason="stop", usage=usage),
    ]
    a, b = merge_deltas(held)
    assert (a.request_id, a.seq_no, a.token_offset, a.text_offset) == ("a", 4, 16, 16)
    assert (a.token_ids, a.text, a.finish_reason) == ([1, 2, 3, 4], "abcd", None)
    assert [x.token_id for x in a.logprobs or []] == [1, 2, 3, 4]
    assert (b.request_id, b.seq_no, b.token_offset, b.token_ids, b.text) == (
        "b",
        8,
        24,
        [5, 6],
        "ef",
    )
    assert (b.finish_reason, b.usage, b.logprobs) == ("stop", usage, None)
    # it encodes and decodes like any batch; one delta per request is left as it was
    batch = decode_as(TokenDeltaBatch, encode(TokenDeltaBatch(reply_to="g", deltas=[a, b])))
    assert batch.deltas == [a, b]
    single = held[:2]
    assert merge_deltas(single) is single
