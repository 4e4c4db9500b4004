"""`sluice serve` as a benchmark's child process: on a free port with a data dir of its
own, ready (/readyz 200), stopped on exit; and the engine processes it spawned."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from sluice.tansu import free_port

# the benchmarks' requests name tiny-llama (fast, random weights), not the default model
MODEL_ENV = {"SLUICE_MODEL": "tiny-llama"}


@dataclass(slots=True)
class Served:
    """`sluice serve` in a session of its own (a stop reaches the engine), output in `log`."""

    proc: subprocess.Popen[bytes]
    base_url: str
    data_dir: Path
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@contextlib.contextmanager
def serve(
    workdir: Path, api_key: str, env: Mapping[str, str] | None = None, timeout_s: float = 240.0
) -> Iterator[Served]:
    """`sluice serve --api-key api_key`, data in `workdir/data`, output in
    `workdir/serve.log`, `env` over this process's environment; ready, then SIGTERM on
    exit (SIGKILL after 60 s)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, data_dir, log = free_port(), workdir / "data", workdir / "serve.log"
    args = ["serve", "--port", str(port), "--data-dir", str(data_dir), "--api-key", api_key]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sluice", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **MODEL_ENV, **(env or {})})  # fmt: skip
    served = Served(proc, f"http://127.0.0.1:{port}", data_dir, log)
    try:
        wait_ready(served, timeout_s)
        yield served
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_ready(served: Served, timeout_s: float) -> None:
    """Until /readyz answers 200; RuntimeError with the log's tail if the server exits or
    `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{served.base_url}/readyz", timeout=2).status_code == 200:
                return
        if served.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sluice serve is not ready:\n{served.log_tail()}")
        time.sleep(0.3)


def engine_pids(parent: int) -> set[int]:
    """The engine processes: the children of `parent` that multiprocessing spawned (two
    on a CPU host of two cores or more: `sluice.wiring.resolve_engine_replicas`)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            pids.add(int(entry.name))
    return pids
