"""`benchmarks.http_servers`: servers started together, ready, and stopped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.http_servers import Launch, servers
from sluice.tansu import free_port


def _http_server(port: int) -> Launch:
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return Launch(cmd, dict(os.environ), port, ready_path="/")


def test_servers_are_ready_inside_and_stopped_after(tmp_path: Path) -> None:
    launches = {"a": _http_server(free_port()), "b": _http_server(free_port())}
    with servers(launches, tmp_path, timeout_s=30) as started:
        assert set(started) == {"a", "b"}
        for server in started.values():
            assert httpx.get(server.base_url + "/").status_code == 200
    assert all(server.proc.poll() is not None for server in started.values())
    assert (tmp_path / "a.log").exists()


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    broken = Launch([sys.executable, "-c", "print('no such model'); raise SystemExit(3)"],
                    dict(os.environ), free_port())  # fmt: skip
    with pytest.raises(RuntimeError, match="no such model"), servers({"x": broken}, tmp_path):
        pass
