"""`sluice bulk` as a subprocess on tiny-llama: a whole file, then a run killed with -9
mid-file and resumed: every custom_id once, and the resumed lines equal the first run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.batch_checks import chat_line, jsonl
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

LINES = 30
CUSTOM_IDS = [f"line-{i:02}" for i in range(LINES)]


def chat_file(path: Path) -> Path:
    rows = [chat_line(c, f"Tell me about {c}.", max_tokens=16, ignore_eos=True) for c in CUSTOM_IDS]
    path.write_bytes(jsonl(rows))
    return path


def bulk_args(source: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sluice", "bulk", str(source), "-o", str(output), *extra]


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def contents(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}


def complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_bulk_writes_every_line_once_and_resumes_after_a_kill(
    data_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "SLUICE_DATA_DIR": str(data_dir)}
    source = chat_file(tmp_path / "in.jsonl")

    first = tmp_path / "first.jsonl"
    done = subprocess.run(
        bulk_args(source, first, "--json"), env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["lines"] == summary["ok"] == LINES
    assert summary["failed"] == 0 and summary["output_tokens"] == 16 * LINES
    reference = rows_of(first)
    assert [r["custom_id"] for r in reference] == CUSTOM_IDS  # written in input order
    for row in reference:
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 16

    # one line at a time, so that the kill lands mid-file rather than after the last line
    second = tmp_path / "second.jsonl"
    log = (tmp_path / "second.log").open("wb")
    proc = subprocess.Popen(
        bulk_args(source, second, "--json", "--concurrency", "1"),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its engine process goes down with it
    )
    wait_until(
        lambda: complete_lines(second) >= 5 or proc.poll() is not None, 90, "5 lines written"
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    killed_at = complete_lines(second)
    assert 5 <= killed_at < LINES, (tmp_path / "second.log").read_text()[-3000:]
    with second.open("a") as fh:  # a write the kill tore in half
        fh.write('{"id":"batch_req_torn","custom_id":"line-29","resp')

    resumed = subprocess.run(
        bulk_args(source, second, "--json", "--resume"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["skipped"] == killed_at
    rows = rows_of(second)
    assert sorted(r["custom_id"] for r in rows) == CUSTOM_IDS  # each exactly once
    greedy, again = contents(reference), contents(rows)
    sample = [*CUSTOM_IDS[::5], CUSTOM_IDS[killed_at - 1], CUSTOM_IDS[killed_at]]
    for custom_id in sample:  # before the kill and after it
        assert again[custom_id] == greedy[custom_id], custom_id
