"""`sluice serve` start-up as a person sees it: the URL line means a request is answered
now, the generated key is the same after a restart, and the demo model says it is random."""

from __future__ import annotations

import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.procs import API_KEY, free_port

pytestmark = pytest.mark.slow

NOTICE = (
    "tiny-llama has random weights: replies are gibberish; "
    "serve a real model with --model /path/to/hf-dir"
)
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Serve:
    """`python -m sluice serve`, its stdout read line by line as it comes (a pipe), its
    stderr (the logs and progress lines) in a file."""

    def __init__(self, data_dir: Path, stderr_log: Path, *args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.stderr_log = stderr_log
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        argv = ["serve", "--port", str(self.port), "--data-dir", str(data_dir), *args]
        with open(stderr_log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice", *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # stdout closed: the process ended

    def read_until(self, pattern: str, timeout_s: float = 180.0) -> re.Match[str]:
        """Read stdout until a line matches `pattern`; fail if the process exits first."""
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                message = f"no line {pattern!r} in {timeout_s:.0f}s:\n{self.output()}"
                raise AssertionError(message) from None
            if line is None:
                raise AssertionError(f"sluice serve exited before {pattern!r}:\n{self.output()}")
            self.stdout.append(line)
            if match := re.search(pattern, line):
                return match

    def output(self) -> str:
        return "\n".join(self.stdout) + "\n--- stderr ---\n" + self.stderr_log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def chat(base_url: str, key: str) -> int:
    """One chat completion; no SDK retries, so a 503 fails the test. Returns its tokens:
    the demo model's text may be empty (most of its ids decode to nothing, and unseeded
    sampling is random), so the text proves nothing."""
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60) as c:
        answer = c.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert answer.choices[0].finish_reason in ("stop", "length")
    tokens: int = answer.usage.completion_tokens
    return tokens


def test_the_url_line_means_a_request_is_answered_now(data_dir: Path, tmp_path: Path) -> None:
    serve = Serve(data_dir, tmp_path / "stderr.log", "--api-key", API_KEY)
    try:
        url = serve.read_until(r"sluice serve: serving 'tiny-llama' at (\S+)").group(1)
        assert url == f"{serve.base_url}/v1"
        # at the moment the URL appears: ready, and a request is answered (no 503)
        assert httpx.get(f"{serve.base_url}/readyz", timeout=5).status_code == 200
        assert chat(serve.base_url, API_KEY)
        assert httpx.get(f"{serve.base_url}/health", timeout=5).json() == {"status": "ok"}
        serve.read_until(r"^api key: ")
    finally:
        code = serve.stop()
    assert code == 0, serve.output()
    progress = serve.stderr_log.read_text()
    assert "sluice serve: loading 'tiny-llama'" in progress
    assert re.search(r"sluice serve: engine process pid=\d+(,\d+)* started", progress)
    assert re.search(r"sluice serve: engine ready after [\d.]+s", progress)
    assert NOTICE in serve.stdout  # the demo model says its replies are gibberish


def test_the_generated_key_is_kept_in_the_data_dir_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = []
    for start in range(2):
        serve = Serve(data, tmp_path / f"stderr-{start}.log")
        try:
            line = serve.read_until(r"^api key: (\S+) \(kept in (\S+), reused on every start\)")
            key, kept_in = line.group(1), Path(line.group(2))
            assert chat(serve.base_url, key)
        finally:
            code = serve.stop()
        assert code == 0, serve.output()
        assert key not in serve.stderr_log.read_text()  # never in the logs
        keys.append(key)
    assert keys[0] == keys[1]
    assert kept_in == data / "api_key"
    assert kept_in.read_text().strip() == keys[0]
    assert stat.S_IMODE(kept_in.stat().st_mode) == 0o600
