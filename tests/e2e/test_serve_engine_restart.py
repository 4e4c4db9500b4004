"""`sluice serve` heals its engine: a kill -9 of the engine process under streaming
requests, and every stream still ends as the uninterrupted greedy run does; `/readyz`
says 503 while the engine is down and 200 once it is back."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.sluice_serve import engine_pids
from tests.e2e.procs import API_KEY, SluiceProcess, serving, wait_ready
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPTS = [[5, 6, 7, 8], [1, 17, 42, 99, 7], [300, 12], [9, 9, 11, 40, 2, 3]]
MAX_TOKENS = 1500  # long enough that no stream ends before every one has started
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def served(data_dir: Path, tmp_path: Path) -> Iterator[tuple[str, SluiceProcess]]:
    with serving(data_dir, tmp_path / "serve.log") as served_proc:
        yield served_proc


class Streamer(threading.Thread):
    """One streaming completion; counts its chunks so the test knows it is mid-stream."""

    def __init__(self, client: openai.OpenAI, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.client, self.prompt = client, prompt
        self.text, self.finish, self.chunks = "", None, 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=MODEL, prompt=self.prompt, stream=True, **GREEDY
            )
            for chunk in stream:
                for choice in chunk.choices:
                    self.text += choice.text
                    self.finish = choice.finish_reason or self.finish
                self.chunks += 1
        except BaseException as exc:
            self.error = exc


def test_a_killed_engine_restarts_and_every_stream_completes(
    served: tuple[str, SluiceProcess],
) -> None:
    base, proc = served
    assert proc.proc is not None
    first = engine_pids(proc.proc.pid)
    assert first, "no engine process under sluice serve"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with client:
        expected = [
            client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text
            for p in PROMPTS
        ]
        streams = [Streamer(client, p) for p in PROMPTS]
        for s in streams:
            s.start()

        def started() -> bool:
            assert not any(s.finish for s in streams), "a stream ended before the kill"
            return all(s.chunks >= 1 for s in streams)

        deadline = time.monotonic() + 60
        wait_until(started, 60, "every stream's first chunk", interval_s=0.005)
        for pid in first:  # every stream's engine
            os.kill(pid, signal.SIGKILL)
        statuses = [httpx.get(f"{base}/readyz", timeout=5).status_code]
        while statuses[-1] != 503 and time.monotonic() < deadline:
            statuses.append(httpx.get(f"{base}/readyz", timeout=5).status_code)
        assert statuses[-1] == 503, "/readyz never said the engine was down"
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200  # it heals
        for s in streams:
            s.join(120)
            assert s.error is None, s.error
        wait_ready(base, proc, timeout_s=60)

    for s, text in zip(streams, expected, strict=True):
        assert s.finish == "length"
        assert s.text == text  # no gap, no repeat: the greedy run's text exactly
    second = engine_pids(proc.proc.pid)
    assert len(second) == len(first) and not second & first
    assert "engine restarted" in proc.output()
