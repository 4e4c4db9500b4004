"""`sluice batch`'s pure parts: flags, the batch file's endpoint, progress figures, exit
codes, the polling loop (fed a fake retrieve), and how server errors reach the user."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import typer
from openai.types import Batch

from sluice.cli_batch import (
    BatchInputError,
    BatchProgress,
    NoOutputYet,
    StoppedWaiting,
    connected,
    detect_endpoint,
    download,
    exit_code,
    parse_metadata,
    render_final,
    wait,
)

STARTED = 1_700_000_000


def batch(**fields: Any) -> Batch:
    defaults: dict[str, Any] = {
        "id": "batch_1",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file_in",
        "completion_window": "24h",
        "created_at": STARTED - 5,
        "status": "in_progress",
        "in_progress_at": STARTED,
    }
    return Batch(**{**defaults, **fields})


def counts(completed: int, failed: int, total: int) -> dict[str, int]:
    return {"completed": completed, "failed": failed, "total": total}


def usage(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10 + output_tokens,
    }


def test_metadata_pairs_become_a_dict() -> None:
    assert parse_metadata([]) == {}
    assert parse_metadata(["team=search", "run=7", "note=a=b", "empty="]) == {
        "team": "search",
        "run": "7",
        "note": "a=b",
        "empty": "",
    }


@pytest.mark.parametrize(
    ("pairs", "says"),
    [(["team"], "KEY=VALUE"), (["=x"], "KEY=VALUE"), (["a=1", "a=2"], "a is given twice")],
)
def test_bad_metadata_is_refused_before_anything_is_sent(pairs: list[str], says: str) -> None:
    with pytest.raises(BatchInputError, match=says):
        parse_metadata(pairs)


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_endpoint_is_the_first_lines_url(tmp_path: Path) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
    path = write_lines(tmp_path / "in.jsonl", json.dumps(line), "not read")
    assert detect_endpoint(path) == "/v1/completions"


@pytest.mark.parametrize(
    ("first", "says"),
    [
        ("", "line 1 is empty"),
        ("{not json", "line 1 is not JSON"),
        ('["/v1/completions"]', 'no "url"; pass --endpoint'),
        ('{"custom_id": "a"}', 'no "url"; pass --endpoint'),
        ('{"url": "/v1/embeddings"}', "batches take one of /v1/chat/completions"),
    ],
)
def test_a_first_line_without_a_usable_url_names_the_fix(
    tmp_path: Path, first: str, says: str
) -> None:
    with pytest.raises(BatchInputError, match=says):
        detect_endpoint(write_lines(tmp_path / "in.jsonl", first))


def test_progress_counts_failed_lines_as_done_and_projects_the_rest() -> None:
    running = batch(request_counts=counts(30, 10, 100), usage=usage(2_000))
    figures = BatchProgress.of(running, now_s=STARTED + 20)
    assert (figures.status, figures.done, figures.total, figures.failed) == (
        "in_progress",
        40,
        100,
        10,
    )
    assert figures.output_tokens_per_s == 100.0  # 2,000 tokens in 20 s
    assert figures.eta_s == 30.0  # 60 lines left at 2 lines/s
    assert figures.describe() == "10 failed · 100.0 tok/s · ETA 0:00:30"


def test_progress_omits_what_the_batch_does_not_say() -> None:
    validating = batch(status="validating", in_progress_at=None)
    figures = BatchProgress.of(validating, now_s=STARTED + 20)
    assert (figures.done, figures.total) == (0, 0)
    assert figures.output_tokens_per_s is None and figures.eta_s is None
    assert figures.describe() == "0 failed"
    no_usage = BatchProgress.of(batch(request_counts=counts(1, 0, 4)), now_s=STARTED + 3)
    assert no_usage.output_tokens_per_s is None
    assert no_usage.describe() == "0 failed · ETA 0:00:09"


def test_an_ended_batch_has_no_eta_and_its_rate_stops_at_its_end() -> None:
    ended = batch(
        status="completed",
        finalizing_at=STARTED + 50,
        completed_at=STARTED + 52,
        request_counts=counts(100, 0, 100),
        usage=usage(5_000),
    )
    figures = BatchProgress.of(ended, now_s=STARTED + 3_600)
    assert figures.output_tokens_per_s == 100.0  # over the 50 s it ran, not the hour since
    assert figures.eta_s is None


@pytest.mark.parametrize(
    ("status", "code"),
    [("completed", 0), ("failed", 1), ("expired", 1), ("cancelled", 1)],
)
def test_wait_exits_0_only_for_a_completed_batch(status: str, code: int) -> None:
    assert exit_code(status) == code


def test_wait_reports_every_poll_until_the_batch_ends() -> None:
    answers = iter(
        [
            batch(status="validating", in_progress_at=None),
            batch(request_counts=counts(1, 0, 3)),
            batch(status="finalizing", request_counts=counts(3, 0, 3)),
            batch(status="completed", request_counts=counts(3, 0, 3), output_file_id="file_out"),
        ]
    )
    asked: list[str] = []
    seen: list[str] = []
    sleeps: list[float] = []

    def retrieve(batch_id: str) -> Batch:
        asked.append(batch_id)
        return next(answers)

    final = wait(
        retrieve,
        "batch_1",
        on_progress=lambda b: seen.append(b.status),
        poll_interval_s=0.5,
        sleep=sleeps.append,
    )
    assert final.status == "completed" and final.output_file_id == "file_out"
    assert seen == ["validating", "in_progress", "finalizing", "completed"]
    assert asked == ["batch_1"] * 4
    assert sleeps == [0.5, 0.5, 0.5]  # none after the end


def test_ctrl_c_stops_the_waiting_not_the_batch() -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    with pytest.raises(StoppedWaiting) as stopped:
        wait(lambda batch_id: batch(), "batch_9", sleep=interrupted)
    assert stopped.value.batch_id == "batch_9"


def test_the_final_line_says_how_it_ended_and_where_the_results_are() -> None:
    done = batch(status="completed", request_counts=counts(2, 1, 3), output_file_id="file_out")
    assert render_final(done) == (
        "batch batch_1 completed: 2 succeeded, 1 failed of 3\n"
        "results: sluice batch download batch_1 -o results.jsonl --errors errors.jsonl"
    )
    assert render_final(batch(status="failed", request_counts=None)) == "batch batch_1 failed"


def unused_client() -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-unused", max_retries=0)


def test_download_says_when_there_is_no_output_yet(tmp_path: Path) -> None:
    with pytest.raises(NoOutputYet, match=r"in_progress \(1/3 lines done\): no output file yet"):
        download(unused_client(), batch(request_counts=counts(1, 0, 3)), tmp_path / "out.jsonl")
    failed = batch(status="failed", errors={"data": [{"message": "line 2 has no custom_id"}]})
    with pytest.raises(NoOutputYet, match="failed \\(line 2 has no custom_id\\): it has no output"):
        download(unused_client(), failed, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_server_error_is_one_line_on_stderr_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/batches")
    body = {"message": "Invalid endpoint:\n /v1/embeddings", "type": "invalid_request_error"}
    response = httpx2.Response(400, request=request, json={"error": body})
    with pytest.raises(typer.Exit) as exited, connected("http://127.0.0.1:9/v1", "sk-test"):
        raise openai.BadRequestError("Error code: 400", response=response, body=body)
    assert exited.value.exit_code == 2
    assert capsys.readouterr().err == "error: 400 Invalid endpoint: /v1/embeddings\n"


def test_no_api_key_exits_2_naming_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as exited, connected("http://127.0.0.1:9/v1", None):
        pass
    assert exited.value.exit_code == 2
    assert "--api-key or set SLUICE_API_KEY" in capsys.readouterr().err
