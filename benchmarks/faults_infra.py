"""The parts the fault runs break: TCP proxies, a Redis of their own, a `sluice up` fleet.

The fleet's Tansu broker keeps its data in memory, or, for the broker restart, in an
s3rver bucket on disk (`benchmarks.s3_storage`) that outlives its process.

Every process reaches Kafka, Redis and PostgreSQL through a `TcpProxy`, so an outage is
`cut()` (listener and every link closed: connections reset, new ones refused) and
`restore()`; Redis is a server of the run's own that can be restarted for real.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import sqlalchemy as sa

from benchmarks.s3_storage import S3rver
from sluice.settings import BusSettings, load_settings
from sluice.tansu import MEMORY_STORAGE, TansuBroker, free_port, wait_for_port


class TcpProxy:
    """127.0.0.1:`port` → 127.0.0.1:`upstream_port`, one thread per direction of a link.

    Only for services on this machine: the fault runs never send traffic elsewhere.
    """

    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self._links: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            self._listener = socket.create_server(("127.0.0.1", self.port))
            listener = self._listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            self._close_links()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._links += [client, upstream]
                if self._listener is not listener:  # accepted while cut() ran: cut it too
                    self._close_links()
                    return
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _close_links(self) -> None:
        for link in self._links:
            with contextlib.suppress(OSError):
                link.shutdown(socket.SHUT_RDWR)
            link.close()
        self._links = []


@dataclass
class RedisServer:
    """A redis-server of the run's own, without persistence: a restart loses its data."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port("127.0.0.1", self.port, 10.0)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


class Broker(TansuBroker):
    """Tansu on its own port, clients told the proxy's (`advertised_port`); in-memory
    storage, or `storage` with its `env` (an s3rver's bucket, `benchmarks.s3_storage`)."""

    def __init__(
        self,
        advertised_port: int,
        log: Path,
        storage: str = MEMORY_STORAGE,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(log_path=log, binary=load_settings(BusSettings).tansu_bin,
                         storage=storage, env=env, advertised_port=advertised_port)  # fmt: skip


API_KEY = "sk-faults"

# Tansu on S3 storage answers a fetch only once it has listed the partition's batches and
# read those after the fetch's offset from the store; a fetch whose wait runs out first
# comes back empty and is asked again. At the default's 5 ms a consumer that is a few
# batches behind never catches up and keeps the store busy, so requests time out. A
# deployment on durable storage sets SLUICE_KAFKA_FETCH_MAX_WAIT_MS the same way.
DURABLE_FETCH_MAX_WAIT_MS = 100


@dataclass
class Fleet:
    """`sluice up` with two engine workers, billing and quotas, behind the proxies."""

    workdir: Path
    database_url: str
    engine_workers: int = 2
    env: dict[str, str] = field(default_factory=dict)  # more for `sluice up` and its children
    durable: bool = False  # the broker's storage: an s3rver's bucket, else its memory
    port: int = field(default_factory=free_port)
    kafka: TcpProxy | None = None
    broker: Broker | None = None
    s3: S3rver | None = None
    redis: RedisServer | None = None
    redis_proxy: TcpProxy | None = None
    pg_proxy: TcpProxy | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kafka_bootstrap(self) -> str:
        assert self.kafka is not None
        return f"127.0.0.1:{self.kafka.port}"

    def start(self, timeout_s: float = 240.0) -> Fleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        kafka_port = free_port()
        storage, broker_env = MEMORY_STORAGE, {}
        if self.durable:
            self.s3 = S3rver(self.workdir / "s3").start(self.workdir / "s3rver.log")
            storage, broker_env = self.s3.storage, self.s3.tansu_env()
        self.broker = Broker(kafka_port, self.workdir / "tansu.log", storage, broker_env)
        self.broker.start()
        self.kafka = TcpProxy(self.broker.port, port=kafka_port)
        self.redis = RedisServer().start()
        self.redis_proxy = TcpProxy(self.redis.port)
        url = sa.make_url(self.database_url)
        self.pg_proxy = TcpProxy(url.port or 5432)
        proxied = url.set(host="127.0.0.1", port=self.pg_proxy.port)
        env = {
            **os.environ,
            "SLUICE_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "SLUICE_REDIS_URL": f"redis://127.0.0.1:{self.redis_proxy.port}/0",
            "SLUICE_DATABASE_URL": proxied.render_as_string(hide_password=False),
            "SLUICE_ENGINE_GROUP_ID": f"engine-faults-{uuid.uuid4().hex[:6]}",
            "SLUICE_DATA_DIR": str(self.workdir / "data"),
            "SLUICE_MODEL": "tiny-llama",  # the load's requests name it (faults_load.py)
            **(
                {"SLUICE_KAFKA_FETCH_MAX_WAIT_MS": str(DURABLE_FETCH_MAX_WAIT_MS)}
                if self.durable
                else {}
            ),
            **self.env,
        }
        subprocess.run([sys.executable, "-m", "sluice", "migrate"], env=env, check=True,
                       capture_output=True)  # fmt: skip
        out = open(self.workdir / "up.log", "ab")  # noqa: SIM115 - written until stopped
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "up", "--port", str(self.port), "--api-key",
             API_KEY, "--engine-workers", str(self.engine_workers)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Ready once /readyz says so and a request went through both workers' group."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200
                if ready and len(self.worker_pids()) == self.engine_workers and self._answers():
                    return
            time.sleep(0.5)
        raise AssertionError(f"the fleet was not ready in {timeout_s:.0f}s:\n{self.log_tail()}")

    def _answers(self) -> bool:
        body = {"model": "tiny-llama", "prompt": "ready?", "max_tokens": 2}
        r = httpx.post(f"{self.base_url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)  # fmt: skip
        return r.status_code == 200

    def log_tail(self, chars: int = 4000) -> str:
        path = self.workdir / "up.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def pids(self, pattern: str) -> list[int]:
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-f", "-s", str(self.proc.pid), pattern],
                             capture_output=True, text=True).stdout  # fmt: skip
        return [int(pid) for pid in out.split()]

    def worker_pids(self) -> list[int]:
        return self.pids("sluice worker engine")

    def gateway_pids(self) -> list[int]:
        return self.pids("sluice gateway")

    def worker_ready(self, pid: int) -> bool:
        """The engine worker `pid` holds partitions of its group and its engine is up: its
        /readyz, on the metrics port `sluice up` gives each child, answers 200."""
        port = _environ(pid).get("SLUICE_METRICS_PORT")
        if port is None:
            return False
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engine_process_pids(self) -> list[int]:
        """The engine processes the workers spawned (multiprocessing children)."""
        workers = set(self.worker_pids())
        return [pid for pid in self.pids("spawn_main") if _parent(pid) in workers]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for part in (self.kafka, self.redis_proxy, self.pg_proxy):
            if part is not None:
                part.close()
        if self.broker is not None:
            self.broker.stop()
        if self.s3 is not None:
            self.s3.stop()
        if self.redis is not None:
            self.redis.stop()


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def with_children(pid: int) -> list[int]:
    """`pid` and the processes it started (an engine worker's engine process generates)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in task.read_text().split()]
    return [pid, *children]


_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.MULTILINE)


def _requests_running(pid: int) -> float:
    """The requests in the engine of the worker `pid`, from its metrics port (0 without)."""
    port = _environ(pid).get("SLUICE_METRICS_PORT")
    if port is None:
        return 0.0
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in _RUNNING.findall(text))


RUNNING_WAIT_S = 3.0


def busiest(pids: list[int], window_s: float = 0.2) -> int:
    """The process doing the work: the engine worker with the most requests in its engine,
    else the one that used the most CPU (with its children) over a short window. CPU
    alone once picked an idle worker, whose poll loop had spun more in 0.1 s."""
    # the engine's stats reach the metrics port a moment after its requests start: ask
    # again for a while before judging by CPU
    deadline = time.monotonic() + RUNNING_WAIT_S
    while True:
        running = {pid: _requests_running(pid) for pid in pids}
        if max(running.values(), default=0.0) > 0:
            return max(pids, key=lambda pid: running[pid])
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def ticks(pid: int) -> int:
        return sum(cpu_ticks(p) for p in with_children(pid))

    before = {pid: ticks(pid) for pid in pids}
    time.sleep(window_s)
    return max(pids, key=lambda pid: ticks(pid) - before[pid])
