"""Servers a benchmark starts side by side and loads over HTTP: each in a session of its
own (so a stop reaches its children), its output in a log file, ready once its
readiness path answers 200; stopped together, SIGTERM then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start one arm's server: `port` is the one its command line names."""

    cmd: list[str]
    env: dict[str, str]
    port: int
    ready_path: str = "/readyz"


@dataclass(slots=True)
class Server:
    arm: str
    proc: subprocess.Popen[bytes]
    base_url: str
    log: Path
    ready_path: str = "/readyz"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.base_url + self.ready_path, timeout=2).status_code == 200
        return False


@contextlib.contextmanager
def servers(
    launches: dict[str, Launch], workdir: Path, timeout_s: float = 300.0
) -> Iterator[dict[str, Server]]:
    """Every arm's server, started together, each ready; logs in `workdir/<arm>.log`."""
    started: dict[str, Server] = {}
    try:
        for arm, launch in launches.items():
            log = workdir / f"{arm}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    launch.cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=launch.env,
                    start_new_session=True,
                )
            url = f"http://127.0.0.1:{launch.port}"
            started[arm] = Server(arm, proc, url, log, launch.ready_path)
        deadline = time.monotonic() + timeout_s
        for server in started.values():
            while not server.ready():
                if server.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{server.arm} did not become ready:\n{server.log_tail()}")
                time.sleep(0.5)
        yield started
    finally:
        for server in started.values():
            if server.proc.poll() is None:
                os.killpg(server.proc.pid, signal.SIGTERM)
        for server in started.values():
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait()
