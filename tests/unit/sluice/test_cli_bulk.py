"""`sluice bulk` without an engine: its input lines, what a resume skips (a torn last line
cut off, custom_ids and structural errors' line numbers), the ordered writer, the pump
(fed a fake line runner) and the summary."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest

from sluice.bulk_files import (
    Done,
    InputLine,
    OrderedWriter,
    Summary,
    read_done,
    read_input,
    truncate_to_last_line,
)
from sluice.bulk_run import LineResult, Pump

CHAT = "/v1/chat/completions"
MODELS: Any = {"tiny-llama": object()}  # parse_file only asks whether a model is served


def request(custom_id: Any, **changes: Any) -> str:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]},
    }
    line.update(changes)
    return json.dumps(line)


def output_row(custom_id: str | None, error: dict[str, Any] | None = None) -> str:
    response = None if error else {"status_code": 200, "request_id": "req_1", "body": {}}
    return json.dumps({"id": "x", "custom_id": custom_id, "response": response, "error": error})


# -- input lines ---------------------------------------------------------------------------
def test_structural_faults_are_line_errors_with_their_line_numbers() -> None:
    content = "\n".join(
        [
            request("a"),
            "{not json",
            "",  # blank lines are skipped but counted, as an editor numbers lines
            request("a"),
            request("b", url="/v1/embeddings"),
            request("c", body={"model": "gpt-4", "messages": []}),
            request("d"),
        ]
    ).encode()
    lines = read_input(content, CHAT, MODELS)

    assert [(ln.number, ln.custom_id) for ln in lines] == [
        (1, "a"), (2, None), (4, "a"), (5, "b"), (6, "c"), (7, "d"),
    ]  # fmt: skip
    codes = [ln.error["code"] if ln.error else None for ln in lines]
    assert codes == [
        None, "invalid_json_line", "duplicate_custom_id", "invalid_url", "model_not_found", None,
    ]  # fmt: skip
    assert lines[0].body is not None and lines[0].body["model"] == "tiny-llama"
    row = json.loads(lines[1].error_line())
    assert row["custom_id"] is None and row["response"] is None
    assert row["error"]["code"] == "invalid_json_line" and row["error"]["line"] == 2
    assert json.loads(lines[2].error_line())["custom_id"] == "a"


# -- resume --------------------------------------------------------------------------------
def test_a_torn_last_line_is_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"a":1}\n{"b":2}\n{"custom_id":"c","resp')
    assert truncate_to_last_line(path) == len(b'{"custom_id":"c","resp')
    assert path.read_bytes() == b'{"a":1}\n{"b":2}\n'
    assert truncate_to_last_line(path) == 0  # whole lines stay as they are

    path.write_bytes(b'{"custom_id":"only a torn line')
    truncate_to_last_line(path)
    assert path.read_bytes() == b""
    assert truncate_to_last_line(tmp_path / "missing.jsonl") == 0


def test_resume_skips_custom_ids_written_and_redoes_the_torn_one(tmp_path: Path) -> None:
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    refused = {"status_code": 400, "request_id": "req_2", "body": {"error": {}}}
    output.write_text(
        output_row("a")
        + "\n"
        + json.dumps({"id": "y", "custom_id": "b", "response": refused, "error": None})
        + "\n"
        + output_row("c")[:25]  # killed mid-write
    )
    structural = {"code": "invalid_json_line", "message": "bad", "param": None, "line": 2}
    errors.write_text(output_row(None, structural) + "\n")

    done = read_done([output, errors])

    assert done.custom_ids == {"a", "b"}  # a refused line ran: it is done too
    assert done.line_numbers == {2}
    assert done.lines == 3
    assert output.read_text().count("\n") == 2  # the torn line is gone from the file
    content = "\n".join([request("a"), "{bad", request("b"), request("c")]).encode()
    todo = [ln for ln in read_input(content, CHAT, MODELS) if not done.has(ln)]
    assert [ln.custom_id for ln in todo] == ["c"]


def test_nothing_is_done_without_earlier_output(tmp_path: Path) -> None:
    done = read_done([tmp_path / "absent.jsonl"])
    assert done == Done()
    assert not done.has(InputLine(1, "a", {}))


# -- the ordered writer ----------------------------------------------------------------------
def test_results_are_written_in_input_order_as_soon_as_the_earlier_ones_are() -> None:
    out = io.StringIO()
    writer = OrderedWriter(out)
    writer.put(2, "two", ok=True)
    writer.put(1, "one", ok=False)
    assert out.getvalue() == ""  # line 0 still runs: nothing may pass it
    assert writer.buffered == 2
    writer.put(0, "zero", ok=True)
    assert out.getvalue() == "zero\none\ntwo\n"
    writer.put(4, "four", ok=True)
    assert out.getvalue() == "zero\none\ntwo\n"
    assert (writer.next_seq, writer.ok, writer.failed) == (3, 2, 1)

    assert writer.flush_all() == 1  # an interrupted run writes what is done, out of order
    assert out.getvalue().splitlines() == ["zero", "one", "two", "four"]
    assert (writer.ok, writer.failed, writer.buffered) == (3, 1, 0)


def test_failed_lines_go_to_the_error_file_when_there_is_one() -> None:
    out, err = io.StringIO(), io.StringIO()
    writer = OrderedWriter(out, err)
    for seq, ok in enumerate([True, False, True]):
        writer.put(seq, f"line{seq}", ok)
    assert out.getvalue() == "line0\nline2\n"
    assert err.getvalue() == "line1\n"


# -- the pump ------------------------------------------------------------------------------
def lines_of(count: int) -> list[InputLine]:
    return [InputLine(i + 1, f"c{i + 1}", {}) for i in range(count)]


class FakeRunner:
    """Finishes later lines first (fewer loop turns), fails every third, two tokens each;
    a line in `held` waits until its event is set."""

    def __init__(self, held: dict[int, asyncio.Event] | None = None) -> None:
        self.held = held or {}
        self.started: list[int] = []
        self.running = 0
        self.max_running = 0

    async def __call__(self, line: InputLine) -> LineResult:
        self.started.append(line.number)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if line.number in self.held:
                await self.held[line.number].wait()
            for _ in range(10 - line.number % 10):
                await asyncio.sleep(0)  # a loop turn, not a wait: completions reorder
        finally:
            self.running -= 1
        return LineResult(json.dumps({"custom_id": line.custom_id}), line.number % 3 != 0, 2)


def run_pump(
    runner: Any, lines: list[InputLine], *, window: int, max_buffered: int = 100
) -> tuple[bool, Pump, io.StringIO]:
    out = io.StringIO()

    async def main() -> tuple[bool, Pump]:
        pump = Pump(
            runner,
            OrderedWriter(out),
            Summary(len(lines)),
            window=window,
            max_buffered=max_buffered,
        )
        return await pump.run(lines, asyncio.Event(), asyncio.Event(), grace_s=5.0), pump

    complete, pump = asyncio.run(main())
    return complete, pump, out


def test_the_pump_keeps_the_window_and_writes_in_input_order() -> None:
    runner = FakeRunner()
    complete, pump, out = run_pump(runner, lines_of(12), window=4)

    assert complete
    assert runner.max_running == 4
    written = [json.loads(line)["custom_id"] for line in out.getvalue().splitlines()]
    assert written == [f"c{i}" for i in range(1, 13)]
    summary = pump.summary
    assert (summary.ok, summary.failed, summary.output_tokens) == (8, 4, 24)


def test_submission_waits_while_results_wait_for_a_slow_line() -> None:
    async def main() -> tuple[list[int], bool]:
        release = asyncio.Event()
        runner = FakeRunner({1: release})
        pump = Pump(runner, OrderedWriter(io.StringIO()), Summary(8), window=3, max_buffered=2)
        task = asyncio.create_task(pump.run(lines_of(8), asyncio.Event(), asyncio.Event(), 5.0))
        # loop turns: lines 2 and 3 finish and wait behind line 1; two slots are free,
        # but the buffer is full
        for _ in range(100):
            await asyncio.sleep(0)
        started = list(runner.started)
        release.set()
        return started, await task

    started, complete = asyncio.run(main())
    assert started == [1, 2, 3]
    assert complete


def test_a_stop_writes_what_is_done_and_cancels_the_rest() -> None:
    async def main() -> tuple[bool, Pump, str]:
        stop, abandon = asyncio.Event(), asyncio.Event()
        never = asyncio.Event()
        out = io.StringIO()
        runner = FakeRunner({1: never})

        async def run_line(line: InputLine) -> LineResult:
            result = await runner(line)
            stop.set()  # Ctrl-C as line 2 finishes
            abandon.set()  # and again: no grace for line 1
            return result

        pump = Pump(run_line, OrderedWriter(out), Summary(5), window=2, max_buffered=10)
        complete = await pump.run(lines_of(5), stop, abandon, grace_s=60.0)
        return complete, pump, out.getvalue()

    complete, pump, written = asyncio.run(main())
    assert not complete
    assert [json.loads(line)["custom_id"] for line in written.splitlines()] == ["c2"]
    assert pump.abandoned == 1  # line 1, left to a resume; lines 3-5 never started
    assert (pump.summary.ok, pump.summary.failed) == (1, 0)


def test_a_bug_in_a_line_stops_the_run_and_keeps_what_is_done() -> None:
    async def run_line(line: InputLine) -> LineResult:
        if line.number == 2:
            raise RuntimeError("boom")
        return LineResult("done", True)

    out = io.StringIO()
    pump = Pump(run_line, OrderedWriter(out), Summary(3), window=1, max_buffered=10)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(pump.run(lines_of(3), asyncio.Event(), asyncio.Event(), grace_s=5.0))
    assert out.getvalue() == "done\n"  # line 1; line 3 never started


# -- the summary ---------------------------------------------------------------------------
def test_the_summary_reports_lines_tokens_and_rate() -> None:
    summary = Summary(lines=10, skipped=2, ok=6, failed=2, output_tokens=800)
    summary.started_at, summary.ended_at = 100.0, 104.0
    assert summary.as_dict() == {
        "lines": 10,
        "skipped": 2,
        "ok": 6,
        "failed": 2,
        "seconds": 4.0,
        "output_tokens": 800,
        "tokens_per_s": 200.0,
    }
    assert summary.done == 8
    assert summary.describe() == "2 failed · 200.0 tok/s"
