"""`sluice batch submit --wait` then `download`, as subprocesses, against `sluice serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.batch_checks import chat_line, jsonl
from tests.e2e.procs import API_KEY, serving

pytestmark = pytest.mark.slow

CUSTOM_IDS = ["greet-0", "greet-1", "greet-2"]


def batch_file(path: Path) -> Path:
    lines = [chat_line(c, f"Say something, {c}.", max_tokens=8) for c in CUSTOM_IDS]
    path.write_bytes(jsonl(lines))
    return path


def sluice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=240,
    )


def test_submit_wait_and_download_every_line_once(data_dir: Path, tmp_path: Path) -> None:
    with serving(data_dir, tmp_path / "serve.log") as (base, _proc):
        submitted = sluice(
            "batch", "submit", str(batch_file(tmp_path / "in.jsonl")), "--wait", "--json",
            "--url", f"{base}/v1", "--api-key", API_KEY,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        batch = json.loads(submitted.stdout)
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"completed": 3, "failed": 0, "total": 3}

        # the connection from the environment this time
        env = {"SLUICE_URL": f"{base}/v1", "SLUICE_API_KEY": API_KEY}
        out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
        downloaded = sluice(
            "batch", "download", batch["id"], "-o", str(out), "--errors", str(errors), env=env
        )
        assert downloaded.returncode == 0, downloaded.stderr
        assert downloaded.stdout.splitlines()[0] == f"wrote 3 lines to {out}"

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["custom_id"] for row in rows) == CUSTOM_IDS
    for row in rows:
        assert row["error"] is None
        assert row["response"]["status_code"] == 200
        assert row["response"]["body"]["usage"]["completion_tokens"] == 8
    assert errors.read_text() == ""  # no line failed
