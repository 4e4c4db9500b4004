"""What a newcomer meets in the first minutes: one-line errors, keys found where they are
kept, quiet logs, and `up` saying it serves only once it answers."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from sluice import cli_batch
from sluice.cli import app
from sluice.cli_common import QUIETED_LOGGERS, settings_or_exit
from sluice.settings import EngineWorkerSettings, Settings
from sluice.up import call_when_ready
from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving_args
from tests.waiting import wait_until

runner = CliRunner()


def test_serve_on_a_port_in_use_is_one_line_before_anything_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "sluice", "serve", "--port", str(port),
             "--data-dir", str(tmp_path), "--api-key", "k"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"sluice serve: cannot listen on 127.0.0.1:{port}: Address already in use; stop what"
        " holds it or pick another port (--port, $SLUICE_PORT)"
    ], done.stderr
    assert not (tmp_path / "models").exists()  # nothing was loaded or made


def test_serve_with_an_upstream_that_does_not_answer_is_503_naming_it(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        upstream = f"http://127.0.0.1:{closed.getsockname()[1]}"  # nobody listens
    port = free_port()
    args = serving_args("serve", port, tmp_path)
    args += ["--upstream-url", upstream]  # the backend it implies: upstream
    proc = SluiceProcess(args, tmp_path / "serve.log", {"SLUICE_ENGINE_WAIT_S": "0.5"}).start()
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def answer() -> httpx.Response | None:
        assert proc.proc is not None and proc.proc.poll() is None, proc.output()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            reply = httpx.post(url, json=body, headers=headers, timeout=60)
        except httpx.ConnectError:
            return None  # not listening yet
        loading = reply.status_code == 503 and reply.json()["error"]["code"] == "engine_not_ready"
        return None if loading else reply  # loading: the first health check not made yet

    try:
        reply = wait_until(answer, 120, "an answer past start-up", interval_s=0.2)
    finally:
        code = proc.stop()
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] and reply.headers["x-should-retry"] == "true"
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "engine_unavailable")
    assert error["message"].startswith(f"no engine is up: the upstream server at {upstream}")
    assert "health check" in error["message"] and "--upstream-url" in error["message"]
    assert code == 0, proc.output()[-3000:]


@pytest.mark.parametrize(
    ("given", "root"),
    [
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000/prefix/v1", "http://h:8000/prefix"),
        ("http://h:8000", "http://h:8000"),
    ],
)
def test_an_openai_base_url_names_the_same_upstream_server(given: str, root: str) -> None:
    assert EngineWorkerSettings(upstream_urls=given).upstream_urls == [root]
    assert EngineWorkerSettings(upstream_urls=[given]).upstream_urls == [root]


def test_serve_help_names_only_the_upstreams_that_work() -> None:
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    assert "llama.cpp" not in result.output and "SGLang" in result.output


def test_a_price_without_a_cached_input_price_bills_cached_tokens_as_input(
    tmp_path: Path,
) -> None:
    data = ["--data-dir", str(tmp_path)]
    result = runner.invoke(app, ["prices", "set", "m", "--input", "0.5", "--output", "2", *data])
    assert result.exit_code == 0, result.output
    listed = json.loads(runner.invoke(app, ["prices", "list", "--json", *data]).output)
    assert listed[0]["cached_input_usd"] == listed[0]["input_usd"] == "0.5"


def test_batch_finds_the_key_serve_keeps_for_a_local_server_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    (tmp_path / "api_key").write_text("sk-sluice-kept\n")
    for url in ("http://127.0.0.1:8000/v1", "http://localhost:9/v1", "http://[::1]:8000/v1"):
        with cli_batch.make_client(url, None) as client:
            assert client.api_key == "sk-sluice-kept"
    with cli_batch.make_client("http://127.0.0.1:8000/v1", "given") as client:
        assert client.api_key == "given"
    with pytest.raises(cli_batch.BatchInputError) as refused:
        cli_batch.make_client("https://llm.example.com/v1", None)
    assert "SLUICE_API_KEY" in str(refused.value) and "OPENAI_API_KEY" in str(refused.value)


def test_routine_work_does_not_log_at_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_LOG_LEVEL", "INFO")
    settings_or_exit(Settings)
    for name in ("celery.app.trace", "alembic.runtime.migration"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO)
        assert logging.getLogger(name).isEnabledFor(logging.WARNING)
    assert set(QUIETED_LOGGERS) >= {"celery.app.trace", "alembic.runtime.migration"}


class _Readiness(http.server.BaseHTTPRequestHandler):
    ready = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200 if self.ready.is_set() else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def readiness() -> Iterator[tuple[str, threading.Event]]:
    handler = type("Handler", (_Readiness,), {"ready": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/readyz", handler.ready
    server.shutdown()
    server.server_close()


def test_up_announces_only_once_the_gateway_and_an_engine_worker_are_ready(
    readiness: tuple[str, threading.Event],
) -> None:
    url, ready = readiness
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/readyz"  # nobody listens
    announced = threading.Event()
    stopped = threading.Event()
    # the gateway answers 503 while loading; one of two engine workers is not up at all
    watcher = call_when_ready([[url], [refused, url]], announced.set, stopped, poll_s=0.01)
    assert not announced.wait(0.3)
    ready.set()
    assert announced.wait(10)
    watcher.join(10)
    assert not watcher.is_alive()


def test_up_never_announces_once_it_stopped(readiness: tuple[str, threading.Event]) -> None:
    url, ready = readiness
    announced = threading.Event()
    stopped = threading.Event()
    watcher = call_when_ready([[url]], announced.set, stopped, poll_s=0.01)
    stopped.set()
    watcher.join(10)
    ready.set()
    assert not announced.is_set()


@pytest.mark.parametrize(("native", "picked"), [(True, "bfloat16"), (False, "float32")])
def test_dtype_auto_is_bf16_where_the_cpu_multiplies_bf16(
    monkeypatch: pytest.MonkeyPatch, native: bool, picked: str
) -> None:
    from sluice import wiring
    from sluice.engine.models import cpu_linear

    monkeypatch.setattr(cpu_linear, "native_low_precision", lambda dtype: native)
    settings = EngineWorkerSettings(dtype="auto")
    assert wiring.resolve_dtype(settings, "cpu") == picked
    assert wiring.resolve_dtype(settings, "cuda:0") == "bfloat16"
    assert wiring.resolve_dtype(EngineWorkerSettings(dtype="float32"), "cuda") == "float32"
