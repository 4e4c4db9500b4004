"""Background responses across a restart of `sluice serve` (its SQLite store kept).

A finished response stays readable and re-streams from `starting_after` with the events
numbered as first sent; one running when the process was killed does not stay
`in_progress`: the restarted server's sweep fails it, with an error saying so, once the
dead process's lease on it lapsed (`api.stored_responses`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving_args, wait_ready
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
SIM = {"SLUICE_BACKEND": "sim", "SLUICE_SIM_PRESET": "h100-llama3.1-8b-fp8"}


@contextmanager
def started(data_dir: Path, log: Path) -> Iterator[tuple[openai.OpenAI, SluiceProcess]]:
    port = free_port()
    proc = SluiceProcess(serving_args("serve", port, data_dir), log, SIM).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as sdk:
            yield sdk, proc
    finally:
        proc.stop()


def finished(sdk: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Any:
    seen: dict[str, Any] = {}

    def done() -> bool:
        seen["r"] = sdk.responses.retrieve(response_id)
        return seen["r"].status not in ("queued", "in_progress")

    wait_until(done, timeout_s, f"{response_id} to finish", interval_s=0.5)
    return seen["r"]


def test_a_restart_keeps_finished_responses_and_fails_the_interrupted(
    tmp_path: Path, data_dir: Path
) -> None:
    with started(data_dir, tmp_path / "first.log") as (sdk, proc):
        short = sdk.responses.create(
            model=MODEL, input="a short one", max_output_tokens=12, background=True
        )
        before = finished(sdk, short.id)
        events = [e.model_dump() for e in sdk.responses.retrieve(short.id, stream=True)]
        long = sdk.responses.create(model=MODEL, input="a long one", background=True)
        stream = sdk.responses.retrieve(long.id, stream=True)
        deltas = 0
        for event in stream:
            deltas += event.type == "response.output_text.delta"
            if deltas == 2:
                break
        assert proc.proc is not None
        os.killpg(proc.proc.pid, signal.SIGKILL)  # no shutdown: its lease is left to lapse
        proc.proc.wait()

    with started(data_dir, tmp_path / "second.log") as (sdk, _):
        assert sdk.responses.retrieve(short.id).model_dump() == before.model_dump()
        replay = sdk.responses.retrieve(short.id, stream=True, starting_after=3)
        assert [e.model_dump() for e in replay] == events[4:]
        interrupted = finished(sdk, long.id)
        assert interrupted.status == "failed" and interrupted.error is not None
        assert "stopped before it finished" in interrupted.error.message
        last = list(sdk.responses.retrieve(long.id, stream=True, starting_after=0))[-1]
        assert last.type == "response.failed"
