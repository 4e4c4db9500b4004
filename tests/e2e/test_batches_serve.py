"""The Batch API on `sluice serve` (embedded mode), driven by the official openai SDK."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.batch_checks import (
    chat_line,
    check_each_once,
    content_of,
    jsonl,
    results,
    sdk_client,
    submit,
    unlike_alone,
    usage_in_files,
    wait,
    wait_for_progress,
)
from tests.e2e.procs import serving
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("batches") / "serve.log"
    with serving(data_dir, log, {"SLUICE_BATCH_GRACE_S": "3"}) as (base, _):
        yield base


@pytest.fixture
def client(served: str) -> Iterator[openai.OpenAI]:
    with sdk_client(served) as c:
        yield c


def test_each_line_equals_its_request_sent_alone(client: openai.OpenAI) -> None:
    lines = [chat_line(f"chat-{i}", f"tell me about {i} rivers") for i in range(5)]
    lines.append(chat_line("chat-n2", "two answers", n=2, seed=7))
    batch = wait(client, submit(client, jsonl(lines)).id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == len(lines)
    assert batch.usage is not None and batch.usage.output_tokens > 0
    out, err = results(client, batch)
    assert not err
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]  # input order
    assert [x["response"]["status_code"] for x in out[:5]] == [200] * 5
    assert unlike_alone(client, lines[:5], out[:5]) == []
    assert len(out[-1]["response"]["body"]["choices"]) == 2


def test_completions_and_responses_endpoints(client: openai.OpenAI) -> None:
    body = {"model": "tiny-llama", "prompt": [[1, 45, 99], [1, 36]], "max_tokens": 6}
    body["temperature"] = 0
    lines = [{"custom_id": "c0", "method": "POST", "url": "/v1/completions", "body": body}]
    batch = wait(client, submit(client, jsonl(lines), "/v1/completions").id)
    out, _ = results(client, batch)
    alone = client.completions.create(**body)
    assert [c["text"] for c in out[0]["response"]["body"]["choices"]] == [
        c.text for c in alone.choices
    ]
    rbody = {"model": "tiny-llama", "input": "a haiku", "max_output_tokens": 8, "temperature": 0}
    lines = [{"custom_id": "r0", "method": "POST", "url": "/v1/responses", "body": rbody}]
    batch = wait(client, submit(client, jsonl(lines), "/v1/responses").id)
    out, _ = results(client, batch)
    assert content_of(out[0]) == client.responses.create(**rbody).output_text


def test_invalid_file_fails_with_line_numbers(client: openai.OpenAI) -> None:
    good = chat_line("a", "hi")
    bad_url = {**chat_line("b", "hi"), "url": "/v1/completions"}
    unknown_model = chat_line("c", "hi")
    unknown_model["body"]["model"] = "no-such-model"
    content = jsonl([good, "{not json", good, bad_url, unknown_model])
    batch = wait(client, submit(client, content).id)
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data
    found = {(e.line, e.code) for e in batch.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "model_not_found"),
    }


def test_a_body_the_endpoint_refuses_fails_that_line_only(client: openai.OpenAI) -> None:
    lines = [chat_line("ok-0", "hi"), chat_line("too-long", "hi", max_tokens=10**6)]
    lines.append(chat_line("ok-1", "hello"))
    batch = wait(client, submit(client, jsonl(lines)).id)
    assert batch.status == "completed"
    out, err = results(client, batch)
    assert [x["custom_id"] for x in out] == ["ok-0", "ok-1"]
    assert err[0]["custom_id"] == "too-long"
    assert err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert batch.request_counts is not None and batch.request_counts.failed == 1


def test_cancel_keeps_finished_lines(client: openai.OpenAI) -> None:
    lines = [chat_line(f"l{i}", f"story {i}", max_tokens=200, ignore_eos=True) for i in range(500)]
    batch = submit(client, jsonl(lines))
    wait_for_progress(client, batch.id, 3)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"}
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    out, err = results(client, batch)
    check_each_once(lines, out, err)
    assert out, "lines finished before the cancel are kept"
    assert {e["error"]["code"] for e in err if e["error"]} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(wait(client, submit(client, jsonl(lines[:1])).id).id)


def test_list_and_metadata(client: openai.OpenAI) -> None:
    batch = submit(client, jsonl([chat_line("only", "hi")]))
    page = client.batches.list(limit=2)
    assert page.data[0].id == batch.id
    assert page.data[0].metadata == {"test": "e2e"}
    assert page.has_more
    wait(client, batch.id)


# -- its own data dirs: tenants, a short window, a kill -9 ----------------------------------
def _tenant_key(data_dir: Path, name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sluice", "tenants", "create", name, "--json"],
        env={"SLUICE_DATA_DIR": str(data_dir), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return str(json.loads(out)["api_key"])


def test_tenant_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    data = tmp_path / "data"
    key_a, key_b = _tenant_key(data, "tenant-a"), _tenant_key(data, "tenant-b")
    with serving(data, tmp_path / "serve.log") as (base, _):
        a, b = sdk_client(base, key_a), sdk_client(base, key_b)
        batch = wait(a, submit(a, jsonl([chat_line("x", "hi")])).id)
        assert batch.status == "completed"
        for call in (
            lambda: b.batches.retrieve(batch.id),
            lambda: b.batches.cancel(batch.id),
            lambda: b.files.retrieve(batch.input_file_id),
            lambda: b.files.content(str(batch.output_file_id)),
            lambda: b.files.delete(batch.input_file_id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert b.batches.list().data == [] and b.files.list().data == []
        assert a.files.retrieve(batch.input_file_id).id == batch.input_file_id


def test_expired_batch_keeps_finished_lines(tmp_path: Path) -> None:
    env = {"SLUICE_BATCH_WINDOW_S": "5", "SLUICE_BATCH_SWEEP_S": "0.5", "SLUICE_BATCH_GRACE_S": "2"}
    lines = [chat_line(f"e{i}", f"essay {i}", max_tokens=48, ignore_eos=True) for i in range(1500)]
    with serving(tmp_path / "data", tmp_path / "serve.log", env) as (base, _):
        client = sdk_client(base)
        batch = wait(client, submit(client, jsonl(lines)).id, timeout_s=120)
        assert batch.status == "expired" and batch.expired_at is not None, batch
        out, err = results(client, batch)
        check_each_once(lines, out, err)
        assert out and err
        assert {e["error"]["code"] for e in err if e["error"]} == {"batch_expired"}
        counts, usage = batch.request_counts, batch.usage
        assert counts is not None and usage is not None
        assert counts.completed + counts.failed == counts.total == len(lines)
        reported = (usage.input_tokens, usage.output_tokens)
        assert usage_in_files(out, err) == reported
        assert _ledger_totals(tmp_path / "data", batch.id, reported) == reported


def _ledger_totals(data: Path, batch_id: str, expected: tuple[int, int]) -> tuple[int, int]:
    """Σ (prompt, completion) of the batch's ledger rows, once the billing consumer has
    caught up with `expected` (or 20 s passed)."""
    import sqlite3

    query = "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM usage_ledger "
    query += "WHERE batch_id = ?"

    def totals() -> tuple[int, int]:
        with sqlite3.connect(data / "sluice.db") as db:
            prompt, completion = db.execute(query, (batch_id,)).fetchone()
        return (prompt or 0, completion or 0)

    with contextlib.suppress(AssertionError):  # the caller's assert says what differs
        wait_until(lambda: totals() == expected, 20, "the ledger", interval_s=0.2)
    return totals()


def test_kill_9_of_serve_mid_batch_then_restart_completes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    lines = [chat_line(f"k{i}", f"poem {i}", max_tokens=64, ignore_eos=True) for i in range(300)]
    with serving(data, tmp_path / "first.log") as (base, proc):
        client = sdk_client(base)
        batch = submit(client, jsonl(lines))
        wait_for_progress(client, batch.id, 5)
        assert proc.proc is not None
        proc.proc.kill()
        proc.proc.wait()
        proc.proc.returncode = 0  # killed on purpose: `serving` checks the exit code
    with serving(data, tmp_path / "second.log") as (base, _):
        client = sdk_client(base)
        batch = wait(client, batch.id)
        assert batch.status == "completed", batch
        out, err = results(client, batch)
        assert not err
        check_each_once(lines, out, err)


def test_ledger_rows_carry_the_batch_at_its_discount(tmp_path: Path) -> None:
    import sqlite3

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "sluice", "prices", "set", "tiny-llama", "--input", "1",
         "--cached-input", "0.5", "--output", "2", "--batch-discount", "0.5"],
        env={"SLUICE_DATA_DIR": str(data), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
    )  # fmt: skip
    lines = [chat_line(f"p{i}", f"price {i}", max_tokens=8, ignore_eos=True) for i in range(4)]
    with serving(data, tmp_path / "serve.log") as (base, _):
        client = sdk_client(base)
        batch = wait(client, submit(client, jsonl(lines)).id)
        assert batch.status == "completed"
        query = "SELECT request_id, prompt_tokens, completion_tokens, cost_picos, lane "
        query += "FROM usage_ledger WHERE batch_id = ?"

        def ledger() -> list[tuple[str, int, int, int, str]]:
            with sqlite3.connect(data / "sluice.db") as db:
                return db.execute(query, (batch.id,)).fetchall()

        with contextlib.suppress(AssertionError):  # the asserts below say what differs
            wait_until(lambda: len(ledger()) == len(lines), 15, "the ledger", interval_s=0.2)
        rows = ledger()
    assert len({r[0] for r in rows}) == len(rows) == len(lines)
    for _, prompt, completion, cost, lane in rows:
        assert lane == "batch" and completion == 8
        assert cost == (prompt * 1_000_000 + completion * 2_000_000) // 2  # half price
    assert batch.usage is not None
    assert batch.usage.output_tokens == sum(r[2] for r in rows)
