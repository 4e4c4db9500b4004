"""`sluice serve` (tiny-llama, memory bus): a stream whose connection dropped resumes with
`Last-Event-ID`, text equal to an uninterrupted run and billed once; one not resumed
within the window is cancelled, billed for what was generated."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.procs import API_KEY, serving
from tests.sse import Events, read_events
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def _serve(data_dir: Path, log: Path, window_s: float) -> Iterator[str]:
    env = {"SLUICE_STREAM_RESUME_WINDOW_S": str(window_s)}
    with serving(data_dir, log, env) as (base, _):
        yield base


@pytest.fixture(scope="module")
def served(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(data_dir, tmp_path_factory.mktemp("resume") / "serve.log", 30)


@pytest.fixture(scope="module")
def served_short_window(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # far shorter than the generation asked: the window passes while it runs
    yield from _serve(data_dir, tmp_path_factory.mktemp("resume") / "short.log", 0.5)


def _body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _stream(
    base: str, body: dict[str, Any], stop_after: int | None = None, last_id: str | None = None
) -> tuple[str, Events]:
    """(x-request-id, the (id, data) events read); stops after `stop_after` events."""
    headers = dict(HEADERS)
    if last_id is not None:
        headers["Last-Event-ID"] = last_id
    events: Events = []
    url = f"{base}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        read_events(r.iter_lines(), events, stop_after)  # returning closes the connection
        return r.headers["x-request-id"], events


def _text(events: Events) -> str:
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    return "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])


def _shown_usage(events: Events) -> dict[str, Any]:
    [usage] = [json.loads(d)["usage"] for _, d in events if d != "[DONE]" and '"usage":{' in d]
    return usage


def _ledger(data_dir: Path, request_id: str) -> list[tuple[int, int, int, str]]:
    query = "SELECT attempt, prompt_tokens, completion_tokens, finish_reason FROM usage_ledger"
    with sqlite3.connect(data_dir / "sluice.db") as db:
        return db.execute(query + " WHERE request_id = ?", (request_id,)).fetchall()


def test_a_dropped_stream_resumes_equal_to_an_uninterrupted_run_billed_once(
    served: str, data_dir: Path
) -> None:
    with openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0) as client:
        reference = ""
        for chunk in client.chat.completions.create(
            model="tiny-llama",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            reference += "".join(c.delta.content or "" for c in chunk.choices)

    request_id, first = _stream(served, _body(300), stop_after=6)
    last_id = [i for i, _ in first if i is not None][-1]
    resumed_id, rest = _stream(served, _body(300), last_id=last_id)

    assert resumed_id != request_id  # its own HTTP request, the same generation
    assert _text(first) + _text(rest) == reference
    assert rest[-1][1] == "[DONE]"
    shown = _shown_usage(rest)
    assert shown["completion_tokens"] == 300

    def one_row_set() -> list[tuple[int, int, int, str]]:
        return _ledger(data_dir, request_id)

    rows = wait_until(one_row_set, 30, "the ledger row", interval_s=0.2)
    assert [(r[1], r[2]) for r in rows] == [(shown["prompt_tokens"], shown["completion_tokens"])]
    assert not _ledger(data_dir, resumed_id)  # the resume published nothing


def test_a_stream_not_resumed_within_the_window_is_billed_for_what_ran(
    served_short_window: str, data_dir: Path
) -> None:
    served = served_short_window
    request_id, first = _stream(served, _body(1500), stop_after=4)
    seen = len(_text(first))

    def rows() -> list[tuple[int, int, int, str]]:
        return _ledger(data_dir, request_id)

    # cancelled once the window passes, not at max_tokens
    [(_, _, completion_tokens, finish)] = wait_until(rows, 60, "the ledger row", interval_s=0.2)
    assert finish == "abort"
    assert 0 < completion_tokens < 1500
    assert seen > 0
    last_id = [i for i, _ in first if i is not None][-1]
    r = httpx.post(
        f"{served}/v1/chat/completions",
        json=_body(1500),
        headers={**HEADERS, "Last-Event-ID": last_id},
        timeout=30,
    )
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "stream_not_found"
