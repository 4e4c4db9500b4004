"""The batches collector on a real broker (Tansu) and a real PostgreSQL store.

The test plays the engine: it writes `TokenDeltaBatch`es for a batch's lines to
`sluice.tokens.batches.v1`, with a redelivered delta, a fenced lower attempt and a
resumed attempt overlapping by offsets, stops the collector with one line unfinished and
starts another. Every commit the collectors make is checked against the store at that
moment: a committed offset never passes the first record of a line not yet stored.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from sluice.bus.base import Consumer, Record, TopicPartition, TopicSpec
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.consumers.batches.collector import BatchCollector
from sluice.storage.batches import BatchInfo, BatchStore, NewLine
from sluice.storage.db import Database, make_engine, migrate
from sluice.storage.health import check_database
from tests.integration.storage.stores import DATABASE_URL, pg_schema
from tests.services import service_missing
from tests.unit.api.fakes import served_model
from tests.unit.consumers.batch_replies import TOPIC, delta, publish
from tests.waiting import wait_until

pytestmark = pytest.mark.kafka

MODEL = served_model("tiny", max_model_len=256)


@pytest.fixture(scope="module")
def store() -> Iterator[BatchStore]:
    try:
        check_database(DATABASE_URL)
    except Exception as exc:
        service_missing(f"PostgreSQL at {DATABASE_URL}: {exc}")
    with pg_schema("sluice_batches") as url:
        engine = make_engine(url)
        migrate(engine)
        db = Database(engine)
        yield BatchStore(db)
        db.close()


@dataclass(frozen=True)
class Commit:
    offsets: dict[TopicPartition, int]
    unstored: frozenset[int]  # lines not stored when the commit went out


class RecordingConsumer:
    """The real consumer; each commit is logged with the store's unstored lines at that
    moment (the collector commits on its own thread, after storing what it finished)."""

    def __init__(self, inner: Consumer, on_commit: Callable[[dict[TopicPartition, int]], None]):
        self.inner = inner
        self.on_commit = on_commit

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        return self.inner.poll(timeout_s, max_records)

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        self.on_commit(dict(offsets))
        self.inner.commit(offsets, wait)

    def assignment(self) -> set[TopicPartition]:
        return self.inner.assignment()

    def pause(self, partitions: Sequence[TopicPartition]) -> None:
        self.inner.pause(partitions)

    def resume(self, partitions: Sequence[TopicPartition]) -> None:
        self.inner.resume(partitions)

    def paused(self) -> set[TopicPartition]:
        return self.inner.paused()

    def close(self) -> None:
        self.inner.close()


class RecordingBus(KafkaEventBus):
    def __init__(self, bootstrap: str, store: BatchStore, batch_id: str) -> None:
        super().__init__(KafkaConfig(bootstrap=bootstrap, client_id="batches-collector-test"))
        self.store = store
        self.batch_id = batch_id
        self.commits: list[Commit] = []

    def consumer(self, *args: Any, **kwargs: Any) -> RecordingConsumer:  # type: ignore[override]
        return RecordingConsumer(super().consumer(*args, **kwargs), self._on_commit)

    def _on_commit(self, offsets: dict[TopicPartition, int]) -> None:
        unstored = frozenset(
            line
            for chunk in self.store.lines(self.batch_id, states=["pending", "queued"])
            for line in (info.line for info in chunk)
        )
        self.commits.append(Commit(offsets, unstored))


class Collecting:
    """A collector in a thread; finished batches are noted, not finalized."""

    def __init__(self, bus: RecordingBus, store: BatchStore) -> None:
        self.done_batches: list[str] = []
        self.collector = BatchCollector(
            bus, store, [MODEL], self.done_batches.append, flush_interval_s=0.05
        )
        self.thread = threading.Thread(target=self.collector.run, daemon=True)

    def __enter__(self) -> Collecting:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.collector.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def chat_body(n: int = 1) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": n}
    return json.dumps(body | {"max_tokens": 5, "temperature": 0})


def running_batch(store: BatchStore, lines: int, two_choices: int) -> BatchInfo:
    """A batch in progress whose lines are all queued; line `two_choices` asks n=2."""
    file = store.create_file("tenant-a", "batch", "in.jsonl", b"{}\n")
    batch = store.create_batch(
        tenant_id="tenant-a",
        key_id=None,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        window_s=3600,
        metadata=None,
    )
    new = [
        NewLine(i, f"c{i}", chat_body(), tokens=8, prompt_tokens=3)
        if i != two_choices
        else NewLine(i, f"c{i}", chat_body(2), tokens=16, requests=2, prompt_tokens=6)
        for i in range(lines)
    ]
    store.add_lines(batch.id, new, enqueued_tokens=sum(ln.tokens for ln in new))
    assert store.move(batch.id, ["validating"], "in_progress")
    store.mark_queued(batch.id, list(range(lines)))
    return batch


def stored_texts(store: BatchStore, batch_id: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for chunk in store.lines(batch_id, states=["done"]):
        for info in chunk:
            assert info.ok and info.result is not None, info
            body = json.loads(info.result)["response"]["body"]
            out[info.custom_id] = [c["message"]["content"] for c in body["choices"]]
    return out


def test_each_line_stored_once_and_commits_never_pass_an_unstored_line(
    dedicated_kafka: str, store: BatchStore
) -> None:
    batch = running_batch(store, lines=5, two_choices=4)
    bid = batch.id
    bus = RecordingBus(dedicated_kafka, store, bid)
    end = {"finish_reason": "length"}
    tp = TopicPartition(TOPIC, 0)
    first: dict[int, int] = {}  # line -> offset of its first record
    try:
        # as the batch runner does before it dispatches (else the broker may auto-create
        # it with its own default partitions)
        bus.create_topics([TopicSpec(TOPIC, 1)])
        # written before the first collector starts, so one poll takes them all
        first[0] = publish(bus, delta(bid, 0, 0, 0, 0, "He"))
        publish(bus, delta(bid, 0, 0, 1, 2, "llo", **end))
        publish(bus, delta(bid, 0, 0, 0, 0, "He"))  # redelivered after the line finished
        first[1] = publish(bus, delta(bid, 1, 0, 0, 0, "Hel"))
        publish(bus, delta(bid, 1, 1, 0, 2, "llo", **end))  # resumed: overlaps by one token
        publish(bus, delta(bid, 1, 0, 1, 3, "XX"))  # the superseded attempt, late: fenced
        with Collecting(bus, store) as one:
            wait_until(lambda: store.unfinished(bid) == 3, 60, "lines 0 and 1 stored")
            first[2] = publish(bus, delta(bid, 2, 0, 0, 0, "ab"))  # left unfinished
            first[3] = publish(bus, delta(bid, 3, 0, 0, 0, "xyz", **end))
            first[4] = publish(
                bus,
                delta(bid, 4, 0, 0, 0, "one", **end),
                delta(bid, 4, 0, 0, 0, "two", index=1, **end),
            )
            last = publish(bus, delta(bid, 1, 1, 0, 2, "llo", **end))  # redelivered, stored
            wait_until(lambda: store.unfinished(bid) == 1, 60, "lines 3 and 4 stored")
        # stopped with line 2 unfinished: committed up to its first record, no further
        # (every record before it is of a stored line, the redelivered ones included)
        assert bus.commits[-1].offsets == {tp: first[2]}
        assert one.collector.lines_stored == 4 and one.done_batches == []
        with Collecting(bus, store) as two:
            end_offset = publish(bus, delta(bid, 2, 0, 1, 2, "cde", **end)) + 1
            wait_until(lambda: store.unfinished(bid) == 0, 60, "line 2 stored by the successor")
            wait_until(lambda: two.done_batches == [bid], 60, "the batch reported done")
        assert two.collector.lines_stored == 1
        assert bus.commits[-1].offsets == {tp: end_offset}
        assert last < end_offset
    finally:
        bus.close()
    violations = [
        (c.offsets[tp], line, first[line])
        for c in bus.commits
        if tp in c.offsets
        for line in c.unstored
        if line in first and c.offsets[tp] > first[line]
    ]
    assert violations == [], "committed past the first record of an unstored line"
    assert stored_texts(store, bid) == {
        "c0": ["Hello"],
        "c1": ["Hello"],
        "c2": ["abcde"],
        "c3": ["xyz"],
        "c4": ["one", "two"],
    }
    done = store.get_batch(bid)
    assert done is not None and (done.completed, done.failed) == (5, 0)
    assert done.output_tokens == 5 + 5 + 5 + 3 + 6 and done.enqueued_tokens == 0
