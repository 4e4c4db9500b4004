"""What a batch costs, end to end in-process: the runner and collector, the real engine
worker on the sim backend, and the billing and quotas consumers, on the memory bus and
one SQLite database (issue 33).

The numbers a user relies on: the usage in a batch's output and error files, the batch's
`usage`, and its rows in the ledger are one and the same figure, whether the batch
completed, was cancelled or expired mid-run, or ran out of budget; a line that did not
run costs 0; each line is counted once in `request_counts`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sluice.billing import admin
from sluice.billing.admission import AdmissionService
from sluice.billing.batch_budget import BatchBudget
from sluice.bus.base import TopicPartition
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import USAGE_TOPIC
from sluice.consumers.batches.collector import BatchCollector
from sluice.consumers.batches.lines import parse_request_id
from sluice.consumers.batches.runner import BatchRunner
from sluice.consumers.billing import billing_loop
from sluice.consumers.loop import ConsumeLoop
from sluice.consumers.quotas import quotas_loop
from sluice.storage.batches import BatchInfo, BatchStore, LineOutcome, NewLine
from sluice.storage.db import Database, embedded_url
from sluice.storage.keys import KeyAuthenticator
from sluice.storage.ledger import UsageLedger
from sluice.storage.prices import PriceBook, PriceCache
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.tables import BatchRow, UsageEntry
from tests.unit.consumers.engine_harness import WorkerThread, create_topics
from tests.unit.consumers.sim_engine import RecordingSimBackend
from tests.unit.consumers.test_batches import MODEL, chat, make_runner, wait_until

TENANT_BUDGET_USD = "0.000200"  # 200 micro-dollars: about six lines of 30 tokens


@dataclass
class Stack:
    db: Database
    store: BatchStore
    bus: MemoryEventBus
    runner: BatchRunner
    admission: AdmissionService
    billing: ConsumeLoop
    tenant_id: str


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Everything behind the gateway for batches; a tenant with a budget, and a price of
    1 micro-dollar a token (input or output), no batch discount."""
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    admin.set_price(db, MODEL.name, input_usd="1", cached_input_usd="1", output_usd="1")
    tenant = admin.create_tenant(db, "acme", monthly_budget_usd=TENANT_BUDGET_USD)
    bus = MemoryEventBus()
    create_topics(bus, pools=(MODEL.name,))
    admission = AdmissionService(
        KeyAuthenticator(db), MemoryQuotaStore(), PriceCache(PriceBook(db))
    )
    store = BatchStore(db)
    runner = make_runner(store, bus)
    runner.budget = BatchBudget(admission)
    loops = [billing_loop(bus, UsageLedger(db)), quotas_loop(bus, admission.settler)]
    threads = [threading.Thread(target=loop.run, daemon=True) for loop in loops]
    worker = WorkerThread(
        bus, RecordingSimBackend(step_s=0.01, max_running=4), pool=MODEL.name
    ).start()
    for thread in threads:
        thread.start()
    collector = BatchCollector(
        bus, store, [MODEL], runner.finalize, budget=runner.budget, flush_interval_s=0.02
    )
    collecting = threading.Thread(target=collector.run, daemon=True)
    collecting.start()
    yield Stack(db, store, bus, runner, admission, loops[0], str(tenant["tenant_id"]))
    collector.stop()
    collecting.join(10)
    worker.stop()
    for loop in loops:
        loop.stop()
    for thread in threads:
        thread.join(10)
    bus.close()
    db.close()


def create(s: Stack, lines: list[str], window_s: int = 3600) -> BatchInfo:
    file = s.store.create_file(s.tenant_id, "batch", "in.jsonl", "\n".join(lines).encode())
    return s.store.create_batch(
        tenant_id=s.tenant_id,
        key_id=None,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        window_s=window_s,
        metadata=None,
    )


def status(s: Stack, batch_id: str) -> str:
    batch = s.store.get_batch(batch_id)
    assert batch is not None
    return batch.status


def file_lines(s: Stack, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = s.store.file_content(s.tenant_id, file_id)
    assert content is not None
    return [json.loads(x) for x in content.decode().splitlines()]


def usage_in_files(s: Stack, batch: BatchInfo) -> tuple[int, int, int]:
    """(prompt, cached, completion) summed over the output and error files' lines."""
    prompt = cached = completion = 0
    for line in file_lines(s, batch.output_file_id) + file_lines(s, batch.error_file_id):
        response = line["response"]
        usage = (response or {}).get("body", {}).get("usage")
        if usage is None:
            continue
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        completion += usage["completion_tokens"]
    return prompt, cached, completion


def ledger_rows(s: Stack, batch_id: str) -> list[Any]:
    """The batch's ledger rows, once the billing consumer has read every usage record."""
    end = sum(
        s.bus.end_offset(TopicPartition(USAGE_TOPIC, p))
        for p in range(s.bus.num_partitions(USAGE_TOPIC))
    )
    wait_until(lambda: s.billing.stats.handled >= end)
    query = sa.select(
        UsageEntry.request_id,
        UsageEntry.prompt_tokens,
        UsageEntry.cached_tokens,
        UsageEntry.completion_tokens,
        UsageEntry.cost_picos,
    ).where(UsageEntry.batch_id == batch_id)
    with s.db.session() as session:
        return list(session.execute(query).all())


def check_one_figure(s: Stack, batch_id: str) -> tuple[BatchInfo, list[Any]]:
    """Σ usage in the files == batch.usage == Σ the batch's ledger rows; each line
    counted once; a line that did not run has no usage and costs 0."""
    batch = s.store.get_batch(batch_id)
    assert batch is not None and batch.terminal, batch
    assert batch.completed + batch.failed == batch.total
    rows = ledger_rows(s, batch_id)
    ledger = (
        sum(r.prompt_tokens for r in rows),
        sum(r.cached_tokens for r in rows),
        sum(r.completion_tokens for r in rows),
    )
    reported = (batch.input_tokens, batch.cached_tokens, batch.output_tokens)
    assert usage_in_files(s, batch) == reported == ledger
    unrun = {
        line["custom_id"] for line in file_lines(s, batch.error_file_id) if line["response"] is None
    }
    unrun_lines = {i.line for c in s.store.lines(batch_id) for i in c if i.custom_id in unrun}
    for row in rows:
        ids = parse_request_id(row.request_id)
        assert ids is not None
        if ids[1] in unrun_lines:
            assert (row.prompt_tokens, row.completion_tokens, row.cost_picos) == (0, 0, 0)
    return batch, rows


def test_a_batch_cancelled_mid_run_reports_one_usage_figure(stack: Stack) -> None:
    s = stack
    s.runner.budget = None  # no budget in the way: the cancel ends the batch
    batch = create(s, [chat(f"l{i}", 30) for i in range(40)])
    s.runner.validate(batch.id)
    wait_until(lambda: (s.store.get_batch(batch.id) or batch).completed >= 4)
    assert s.store.move(batch.id, ["in_progress"], "cancelling")
    s.runner.cancel(batch.id)
    wait_until(lambda: status(s, batch.id) == "cancelled")
    done, _ = check_one_figure(s, batch.id)
    assert 4 <= done.completed < 40 and done.failed > 0
    errors = file_lines(s, done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    # lines stopped part-way say so, with what they used; unrun ones say they did not run
    for e in errors:
        if e["response"] is not None:
            assert e["response"]["body"]["usage"]["total_tokens"] > 0
            assert "stopped part-way" in e["error"]["message"]
        else:
            assert "not run" in e["error"]["message"]


def test_an_expired_batch_reports_one_usage_figure_and_counts_each_line_once(
    stack: Stack,
) -> None:
    s = stack
    s.runner.budget = None
    batch = create(s, [chat(f"e{i}", 30) for i in range(40)])
    s.runner.validate(batch.id)
    wait_until(lambda: (s.store.get_batch(batch.id) or batch).completed >= 4)
    with s.db.session() as session:  # the window ends now
        session.execute(sa.update(BatchRow).where(BatchRow.id == batch.id).values(expires_at=0))
    s.runner.expire(batch.id)  # the sweep's step; the collector finalizes once all answered
    wait_until(lambda: status(s, batch.id) == "expired")
    done, _ = check_one_figure(s, batch.id)
    assert done.total == 40 and done.failed > 0
    assert {e["error"]["code"] for e in file_lines(s, done.error_file_id)} == {"batch_expired"}


def test_lines_stop_with_insufficient_quota_when_the_budget_runs_out(stack: Stack) -> None:
    s = stack
    batch = create(s, [chat(f"b{i}", 20) for i in range(20)])
    s.runner.validate(batch.id)
    wait_until(lambda: status(s, batch.id) == "completed", timeout_s=30)
    done, rows = check_one_figure(s, batch.id)
    budget_micros = 200
    assert sum(r.cost_picos for r in rows) <= budget_micros * 1_000_000
    assert 0 < done.completed < 20
    refused = file_lines(s, done.error_file_id)
    assert len(refused) == done.failed == 20 - done.completed
    for line in refused:
        assert line["response"]["status_code"] == 429
        assert line["response"]["body"]["error"]["code"] == "insufficient_quota"
        assert "usage" not in line["response"]["body"]
    # the refused lines never ran: no ledger row is theirs
    assert len(rows) == done.completed


def test_a_line_finished_twice_at_once_is_counted_once(tmp_path: Path) -> None:
    """The collector storing an answer and an expiry ending the same line at once: the
    second writer read the line before the first wrote it, and both counted it."""
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    store = BatchStore(db)
    file = store.create_file("t1", "batch", "in.jsonl", b"{}")
    batch = store.create_batch(
        tenant_id="t1", key_id=None, input_file_id=file.id, endpoint="/v1/chat/completions",
        completion_window="24h", window_s=60, metadata=None,
    )  # fmt: skip
    store.add_lines(batch.id, [NewLine(0, "a", "{}", tokens=10)], enqueued_tokens=10)
    answered = LineOutcome(0, True, '{"answer": 1}', prompt_tokens=3, completion_tokens=5)
    expired = LineOutcome(0, False, '{"expired": 1}')
    raced = threading.Event()

    def the_other_writer_first(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("UPDATE batch_lines") and not raced.is_set():
            raced.set()
            other = threading.Thread(target=store.finish_lines, args=(batch.id, [expired]))
            other.start()
            other.join(10)

    sa.event.listen(db.engine, "before_cursor_execute", the_other_writer_first)
    try:
        store.finish_lines(batch.id, [answered])
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", the_other_writer_first)
    assert raced.is_set()
    done = store.get_batch(batch.id)
    assert done is not None
    assert (done.total, done.completed + done.failed) == (1, 1)
    assert (done.failed, done.input_tokens, done.output_tokens, done.enqueued_tokens) == (
        1,
        0,
        0,
        0,
    )
    db.close()
