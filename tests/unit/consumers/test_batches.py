"""Batch lifecycle in-process: runner + collector on the memory bus, a real SQLite store,
and the fake engine worker of the gateway tests (no model)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.api.prepare import RequestLimits
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import Lane, TopicLayout, pool_id, request_topic
from sluice.consumers.batches.collector import BatchCollector
from sluice.consumers.batches.lines import line_call_id, parse_file, parse_request_id
from sluice.consumers.batches.runner import BatchConfig, BatchRunner, StepLease
from sluice.storage.batches import BatchInfo, BatchStore
from sluice.storage.db import Database, embedded_url
from sluice.tracing import spans as names
from tests.unit.api.fakes import FakeEngineWorker, served_model
from tests.unit.consumers.batch_replies import delta, publish
from tests.unit.tracing.memory_spans import by_name, span_id, spans, trace_id
from tests.waiting import wait_until

__all__ = ["spans"]  # the fixture

MODEL = served_model("tiny", max_model_len=256)
CHAT = "/v1/chat/completions"


def chat(custom_id: str, max_tokens: int = 5, **extra: object) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": max_tokens, "temperature": 0, **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


@pytest.fixture
def bus() -> Iterator[MemoryEventBus]:
    bus = MemoryEventBus()
    bus.create_topics(
        TopicLayout(request_partitions=2, tokens_partitions=1, pools=(MODEL.name,)).specs()
    )
    yield bus
    bus.close()


@pytest.fixture
def engine(bus: MemoryEventBus) -> Iterator[FakeEngineWorker]:
    worker = FakeEngineWorker(bus).start()
    yield worker
    worker.stop()


@pytest.fixture
def store(tmp_path: Path) -> BatchStore:
    return BatchStore(Database.connect(embedded_url(tmp_path), migrate_if_needed=True))


def make_runner(store: BatchStore, bus: MemoryEventBus, **config: object) -> BatchRunner:
    limits = RequestLimits(request_timeout_s=30, max_n=8, max_choices=64, max_logprobs=20)
    return BatchRunner(store, bus, [MODEL], limits, BatchConfig(grace_s=0.5, **config))  # type: ignore[arg-type]


class Collecting:
    """A collector thread whose finished batches are finalized by `runner`."""

    def __init__(self, runner: BatchRunner) -> None:
        self.collector = BatchCollector(
            runner.bus, runner.store, [MODEL], lambda b: runner.finalize(b), flush_interval_s=0.02
        )
        self.thread = threading.Thread(target=self.collector.run, daemon=True)

    def __enter__(self) -> BatchCollector:
        self.thread.start()
        return self.collector

    def __exit__(self, *exc: object) -> None:
        self.collector.stop()
        self.thread.join(10)


def create(store: BatchStore, content: str, tenant: str = "t1") -> BatchInfo:
    file = store.create_file(tenant, "batch", "in.jsonl", content.encode())
    return store.create_batch(
        tenant_id=tenant,
        key_id=None,
        input_file_id=file.id,
        endpoint=CHAT,
        completion_window="24h",
        window_s=3600,
        metadata=None,
    )


def output_lines(store: BatchStore, batch: BatchInfo, file_id: str | None) -> list[dict]:
    assert file_id is not None
    content = store.file_content(batch.tenant_id, file_id)
    assert content is not None
    return [json.loads(x) for x in content.decode().splitlines()]


def test_a_batch_runs_to_completed_with_lines_in_input_order(
    store: BatchStore, bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    runner = make_runner(store, bus)
    batch = create(store, "\n".join([chat("a", 3), chat("b", 20), chat("c", 5, n=2)]) + "\n")
    with Collecting(runner):
        runner.validate(batch.id)
        wait_until(lambda: store.get_batch(batch.id).status == "completed")  # type: ignore[union-attr]
    done = store.get_batch(batch.id)
    assert done is not None and (done.total, done.completed, done.failed) == (3, 3, 0)
    assert done.enqueued_tokens == 0 and done.output_tokens == 3 + 11 + 2 * 5
    out = output_lines(store, done, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["a", "b", "c"]
    texts = [[c["message"]["content"] for c in x["response"]["body"]["choices"]] for x in out]
    assert texts == [["Hel"], ["Hello world"], ["Hello", "Hello"]]
    assert out[0]["response"]["request_id"] == f"req_{line_call_id(batch.id, 0)}"
    assert done.error_file_id is None


def test_structural_errors_fail_the_batch_and_name_their_lines() -> None:
    content = "\n".join([chat("a"), "[1]", chat("a"), chat("b").replace(CHAT, "/v1/x")])
    _, errors = parse_file(content.encode(), CHAT, {"tiny": MODEL}, max_lines=10)
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
    ]
    _, errors = parse_file(("\n".join([chat("a"), chat("b")])).encode(), CHAT, {}, max_lines=1)
    assert errors[0]["code"] == "too_many_requests"


def test_request_ids_name_their_batch_line_and_choice() -> None:
    hex_id = line_call_id("batch_abc", 7)
    assert parse_request_id(f"req_{hex_id}") == ("batch_abc", 7, 0)
    assert parse_request_id(f"req_{hex_id}-3") == ("batch_abc", 7, 3)
    assert parse_request_id("req_0123abcd") is None


def test_the_tenant_queue_limit_fails_a_batch_beyond_it(
    store: BatchStore, bus: MemoryEventBus
) -> None:
    runner = make_runner(store, bus, queue_tokens=40)
    batch = create(store, "\n".join([chat("a", 30), chat("b", 30)]))
    runner.validate(batch.id)
    failed = store.get_batch(batch.id)
    assert failed is not None and failed.status == "failed"
    assert failed.errors and failed.errors[0]["code"] == "token_limit_exceeded"


def test_redelivered_fenced_and_resumed_deltas_store_each_line_once(
    store: BatchStore, bus: MemoryEventBus
) -> None:
    """Nobody runs the lines: the test plays the engine, a failover and a collector crash."""
    runner = make_runner(store, bus)
    batch = create(store, "\n".join([chat("a", 5), chat("b", 5), chat("c", 5)]))
    runner.validate(batch.id)
    end = {"finish_reason": "length"}  # usage: 3 prompt tokens, 5 completion tokens
    with Collecting(runner) as first:
        publish(bus, delta(batch.id, 0, 0, 0, 0, "He"), delta(batch.id, 2, 0, 0, 0, "ab"))
        publish(bus, delta(batch.id, 0, 0, 1, 2, "llo", **end))
        publish(bus, delta(batch.id, 0, 0, 1, 2, "llo", **end))  # redelivered
        # line b: attempt 0 sent "Hel", then a resumed attempt 1 starts over at offset 2
        publish(bus, delta(batch.id, 1, 0, 0, 0, "Hel"))
        publish(bus, delta(batch.id, 1, 1, 0, 2, "llo", **end))
        publish(bus, delta(batch.id, 1, 0, 1, 3, "XX"))  # a zombie's late delta: fenced
        wait_until(lambda: first.lines_stored == 2)
    # the collector died with line c half read; its successor reads it again from Kafka
    with Collecting(runner) as second:
        publish(bus, delta(batch.id, 2, 0, 1, 2, "cde", **end))
        wait_until(lambda: store.get_batch(batch.id).status == "completed")  # type: ignore[union-attr]
        assert second.lines_stored == 1
    done = store.get_batch(batch.id)
    assert done is not None
    out = output_lines(store, done, done.output_file_id)
    texts = [x["response"]["body"]["choices"][0]["message"]["content"] for x in out]
    assert texts == ["Hello", "Hello", "abcde"]
    assert (done.completed, done.output_tokens) == (3, 15)


def test_cancel_aborts_running_lines_and_keeps_finished_ones(
    store: BatchStore, bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    runner = make_runner(store, bus)
    batch = create(store, chat("quick", 2) + "\n")
    with Collecting(runner):
        runner.validate(batch.id)
        wait_until(lambda: store.get_batch(batch.id).status == "completed")  # type: ignore[union-attr]
        engine.mode = "hang"
        slow = create(store, "\n".join([chat("x", 5), chat("y", 5)]))
        runner.validate(slow.id)
        engine.wait_for_requests(3)
        assert store.move(slow.id, ["in_progress"], "cancelling")
        runner.cancel(slow.id)
        wait_until(lambda: store.get_batch(slow.id).status == "cancelled")  # type: ignore[union-attr]
    done = store.get_batch(slow.id)
    assert done is not None and done.output_file_id is None
    errors = output_lines(store, done, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["x", "y"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert runner.finalize(slow.id) is False  # a rerun changes nothing


def test_line_separators_inside_strings_stay_inside_their_line(
    store: BatchStore, bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    """U+2028 and U+0085 may appear raw inside JSON strings: they split no input line,
    and the output lines carry them escaped, so any line reader sees one line each."""
    engine.reply = "a\u2028b\u0085c"
    runner = make_runner(store, bus)
    content = chat("x\u2028y", 5).replace('"hi"', '"h\u2028i\u0085"') + "\n" + chat("z", 5)
    lines, errors = parse_file(content.encode(), CHAT, {"tiny": MODEL}, max_lines=10)
    assert not errors and [ln.custom_id for ln in lines] == ["x\u2028y", "z"]
    batch = create(store, content)
    with Collecting(runner):
        runner.validate(batch.id)
        wait_until(lambda: store.get_batch(batch.id).status == "completed")  # type: ignore[union-attr]
    done = store.get_batch(batch.id)
    assert done is not None and done.output_file_id is not None
    raw = store.file_content(done.tenant_id, done.output_file_id)
    assert raw is not None and raw.isascii()
    out = [json.loads(x) for x in raw.decode().splitlines()]
    assert [x["custom_id"] for x in out] == ["x\u2028y", "z"]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "a\u2028b\u0085c"


def test_in_process_steps_wait_for_the_engine_worker(
    store: BatchStore, bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    """Until this process's engine worker is ready no line is published: the memory
    bus keeps a partition's unread records only for groups that have joined."""
    from sluice.api.routes.batches import BatchLimits
    from sluice.consumers.batches.tasks import InProcessBatches

    ready = threading.Event()
    asked = threading.Semaphore(0)

    def engine_ready() -> bool:
        asked.release()
        return ready.is_set()

    batches = InProcessBatches(
        make_runner(store, bus), BatchLimits(), recover_on_start=False, engine_ready=engine_ready
    ).start()
    try:
        batch = create(store, chat("a", 3) + "\n")
        batches.submitted(batch)
        for _ in range(2):  # the step has asked, been told no, and asked again
            assert asked.acquire(timeout=10), "the step never asked whether the engine is ready"
        assert store.get_batch(batch.id).status == "validating"  # type: ignore[union-attr]
        assert not engine.requests
        ready.set()
        wait_until(lambda: store.get_batch(batch.id).status == "completed")  # type: ignore[union-attr]
    finally:
        batches.stop()


def test_a_step_killed_holding_its_batch_is_rerun_by_the_sweep_once_its_lease_lapses(
    store: BatchStore,
    bus: MemoryEventBus,
    engine: FakeEngineWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [int(time.time())]
    store = BatchStore(store.db, clock=lambda: now[0])
    runner = make_runner(store, bus, publish_chunk=2, lease_s=1)
    batch = create(store, "\n".join(chat(f"l{i}") for i in range(5)) + "\n")
    mark_queued = store.mark_queued

    def killed_after_the_first_chunk(batch_id: str, lines: list[int]) -> None:
        mark_queued(batch_id, lines)
        raise RuntimeError("killed")

    # a kill -9: the step stops after its first chunk and never releases its lease
    with monkeypatch.context() as patch:
        patch.setattr(store, "mark_queued", killed_after_the_first_chunk)
        patch.setattr(StepLease, "release", lambda self: None)
        with pytest.raises(RuntimeError, match="killed"):
            runner.validate(batch.id)
    states = lambda: sorted(i.state for c in store.lines(batch.id) for i in c)  # noqa: E731
    assert states() == ["pending"] * 3 + ["queued"] * 2
    with Collecting(runner):
        runner.sweep()  # the lease still holds: the step may be alive
        assert states().count("pending") == 3
        now[0] += 2  # whole seconds: lapsed once the clock passed its end
        runner.sweep()
        wait_until(lambda: store.get_batch(batch.id).status == "completed")  # type: ignore[union-attr]
    done = store.get_batch(batch.id)
    assert done is not None and (done.total, done.completed, done.failed) == (5, 5, 0)
    assert [x["custom_id"] for x in output_lines(store, done, done.output_file_id)] == [
        f"l{i}" for i in range(5)
    ]


def test_each_line_is_a_trace_rooted_in_its_send_span(
    store: BatchStore,
    bus: MemoryEventBus,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine-side spans of a line's attempts (parented to the context in its
    records' headers) join that line's trace; each line's trace is its own."""
    topic = request_topic(Lane.BATCH, pool_id(MODEL.name))
    parents: list[str] = []
    publish = bus.publish

    def recording(topic_: str, value: bytes, **kwargs: Any) -> Any:
        if topic_ == topic:
            parents.append(dict(kwargs["headers"])["traceparent"].decode().split("-")[2])
        return publish(topic_, value, **kwargs)

    monkeypatch.setattr(bus, "publish", recording)
    batch = create(store, chat("a") + "\n" + chat("b", n=2) + "\n")
    make_runner(store, bus).validate(batch.id)

    def sends() -> list[ReadableSpan]:
        return by_name(spans.get_finished_spans(), f"send {topic}")

    wait_until(lambda: len(sends()) == 2)
    first, second = sends()
    assert first.parent is None and second.parent is None
    assert trace_id(first) != trace_id(second)
    assert [s.attributes[names.BATCH_ID] for s in (first, second)] == [batch.id, batch.id]
    assert second.attributes[names.MESSAGING_BATCH_COUNT] == 2  # n=2: two records
    assert first.attributes[names.REQUEST_ID] == f"req_{line_call_id(batch.id, 0)}"
    # the line's records carry its span as their parent
    assert parents == [f"{span_id(s):016x}" for s in (first, second, second)]
