"""Start real `sluice` processes for end-to-end tests and wait until they serve."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from sluice.storage.health import check_database, check_redis
from sluice.tansu import free_port
from tests.integration.storage.stores import DATABASE_URL, REDIS_URL, pg_schema
from tests.services import service_missing
from tests.waiting import wait_until

API_KEY = "sk-e2e-key"


class SluiceProcess:
    """`python -m sluice ARGS` with its output in a log file; stopped with SIGTERM."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SluiceProcess:
        out = open(self.log, "wb")  # noqa: SIM115 - the child writes to it until stopped
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM the process group (so `sluice up` children drain too); the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def wait_ready(base_url: str, proc: SluiceProcess, timeout_s: float = 180.0) -> None:
    """Poll /readyz until 200; fail with the process log if it dies or never gets there."""

    def ready() -> bool:
        assert proc.proc is not None
        if proc.proc.poll() is not None:
            raise AssertionError(f"sluice exited with {proc.proc.returncode}:\n{proc.output()}")
        try:
            return httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout_s, "/readyz", interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{proc.output()[-5000:]}") from None


def serving_args(command: str, port: int, data_dir: Path) -> list[str]:
    return [command, "--port", str(port), "--data-dir", str(data_dir), "--api-key", API_KEY]


@contextmanager
def serving(
    data_dir: Path, log: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, SluiceProcess]]:
    """`sluice serve` on a free port, ready: (base URL, process); it must exit 0."""
    port = free_port()
    proc = SluiceProcess(serving_args("serve", port, data_dir), log, env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


__all__ = ["API_KEY", "SluiceProcess", "free_port", "serving", "serving_args", "wait_ready"]


@contextmanager
def fleet_database(prefix: str) -> Iterator[str]:
    """A PostgreSQL schema of its own for a fleet of processes that also share Redis; a
    missing service fails the test in CI and skips it elsewhere."""
    try:
        check_database(DATABASE_URL)
        check_redis(REDIS_URL)
    except Exception as exc:
        service_missing(f"PostgreSQL or Redis: {exc}")
    with pg_schema(prefix) as url:
        yield url


@dataclass
class UpStack:
    """A running `sluice up` on the Tansu broker it started: its URL, process, bootstrap."""

    base: str
    proc: SluiceProcess
    bootstrap: str

    def pids(self, pattern: str) -> list[int]:
        """The pids of its children whose command line holds `pattern`."""
        assert self.proc.proc is not None
        out = subprocess.run(
            ["pgrep", "-f", "-s", str(self.proc.proc.pid), pattern],
            capture_output=True,
            text=True,
        ).stdout
        return [int(pid) for pid in out.split()]


@contextmanager
def sluice_up(args: list[str], log: Path, env: dict[str, str], redis_url: str) -> Iterator[UpStack]:
    """`sluice up ARGS` (with `serving_args`' port) on a Tansu of its own (the test's
    SLUICE_KAFKA_BOOTSTRAP dropped), ready; it must exit 0. Redis and Tansu missing fail
    the test in CI and skip it elsewhere."""
    import redis

    from sluice.bus.errors import BusUnavailable
    from sluice.settings import BusSettings, load_settings
    from sluice.tansu import tansu_binary

    try:
        redis.Redis.from_url(redis_url, socket_timeout=2).ping()
    except Exception as exc:
        service_missing(f"Redis at {redis_url}: {exc}")
    try:
        tansu_binary(load_settings(BusSettings).tansu_bin)
    except BusUnavailable as exc:
        service_missing(str(exc))
    port = int(args[args.index("--port") + 1])
    proc = SluiceProcess(args, log, {"SLUICE_REDIS_URL": redis_url, **env})
    proc.env.pop("SLUICE_KAFKA_BOOTSTRAP", None)
    proc.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        found = re.search(r"started Tansu on (\S+)", proc.output())
        assert found, proc.output()[-3000:]
        yield UpStack(base, proc, found[1])
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]
