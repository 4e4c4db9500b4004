"""`sluice up`: the distributed stack as local processes, supervised and stopped together.

Starts a Tansu broker when no Kafka is configured, then one `sluice gateway …`, N
`sluice worker engine …` and any extra workers (`sluice worker billing`, `… quotas`,
`… batches`, `… batches-beat`, `… tracing`), each its own OS process with the equivalent command
line. A child that dies unexpectedly is restarted (with backoff). Ctrl-C or SIGTERM stops
them in dependency order, each once (SIGTERM, SIGKILL only past its timeout): the gateway
(no new requests), the engine workers (they drain), the consumers, then the broker, so no
one loses its broker while it still commits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from sluice.tansu import TansuBroker

logger = logging.getLogger(__name__)

# Shutdown stages, stopped in this order (the broker after all of them).
GATEWAY, ENGINE, CONSUMERS = 0, 1, 2
# What an engine worker may take after its drain (`drain_timeout_s`): aborted requests'
# last steps (5 s), publisher flushes (15 s), engine and task shutdown (15 s), and the
# wait for its group to settle before it leaves (`bus.kafka.SETTLE_BEFORE_LEAVING_S`).
ENGINE_STOP_AFTER_DRAIN_S = 45.0


@dataclass
class Child:
    """One supervised process. `env` adds to the shared environment: secrets go there,
    never on the command line (any local user can read that in `ps`; it is logged too).
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stage: int = CONSUMERS
    stop_timeout_s: float = 20.0
    pool: str | None = None  # an engine worker's model pool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    backoff_s: float = 0.5

    def start(self, env: dict[str, str]) -> None:
        # Its own process group: a Ctrl-C at the terminal reaches `sluice up` alone, which
        # then stops the children in order; dying with it keeps a killed `up` from orphans.
        self.proc = subprocess.Popen(
            self.argv, env={**env, **self.env}, process_group=0, preexec_fn=_die_with_parent()
        )
        self.started_at = time.monotonic()
        logger.info("started %s pid=%s: %s", self.name, self.proc.pid, " ".join(self.argv))


@dataclass
class Supervisor:
    """Keeps children alive until stopped; then stops them stage by stage (`Child.stage`)."""

    children: list[Child]
    env: dict[str, str]
    restart: bool = True
    _stop: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        for child in self.children:
            child.start(self.env)
        while not self._stop.wait(0.2):
            for child in self.children:
                self._check(child)
        self._shutdown()
        return 0

    def _check(self, child: Child) -> None:
        assert child.proc is not None
        code = child.proc.poll()
        if code is None:
            return
        if not self.restart:
            logger.error("%s exited with %s; stopping (--no-restart)", child.name, code)
            self._stop.set()
            return
        # Restart with backoff; a child that ran a while starts over at a short delay.
        if time.monotonic() - child.started_at > 30:
            child.backoff_s = 0.5
        logger.warning("%s exited with %s; restarting in %.1fs", child.name, code, child.backoff_s)
        if self._stop.wait(child.backoff_s):
            return
        child.backoff_s = min(child.backoff_s * 2, 10.0)
        child.restarts += 1
        child.start(self.env)

    def _shutdown(self) -> None:
        for stage in sorted({c.stage for c in self.children}):
            stop_processes(
                [(c.name, c.proc, c.stop_timeout_s) for c in self.children if c.stage == stage]
            )


def stop_processes(
    procs: Sequence[tuple[str, subprocess.Popen[bytes] | None, float]],
) -> None:
    """SIGTERM each (name, process, timeout) once, SIGKILL one still running past its
    timeout, and log a line for each as it stops: name, exit code, seconds."""
    started = time.monotonic()
    waiting = [(name, proc, timeout_s) for name, proc, timeout_s in procs if proc is not None]
    for _, proc, _ in waiting:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    while waiting:
        for item in list(waiting):
            name, proc, timeout_s = item
            if proc.poll() is None and time.monotonic() - started > timeout_s:
                logger.warning("%s did not stop in %.0fs; killing", name, timeout_s)
                proc.kill()
                proc.wait()
            if proc.returncode is not None:
                waiting.remove(item)
                elapsed_s = time.monotonic() - started
                logger.info("stopped %s: exit %s in %.1fs", name, proc.returncode, elapsed_s)
        time.sleep(0.05)


def _die_with_parent() -> Callable[[], object] | None:
    """A preexec_fn asking Linux to SIGTERM the child when `sluice up` dies (even by
    SIGKILL): in its own process group, it no longer dies with `up`'s."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def assign_metrics_ports(children: Sequence[Child], gateway_address: str, targets: Path) -> None:
    """Give each child but the gateway a free metrics port (SLUICE_METRICS_PORT, kept
    across its restarts), tell the gateway its siblings' URLs (SLUICE_METRICS_PEERS, for
    its dashboard), and write them all, the gateway's API port included, to `targets` in
    Prometheus' file_sd format (deploy/prometheus/prometheus.yml reads it)."""
    entries = []
    peers = []
    for child in children:
        if child.stage == GATEWAY:
            address = gateway_address
        else:
            port = _free_port()
            child.env["SLUICE_METRICS_PORT"] = str(port)
            address = f"127.0.0.1:{port}"
            peers.append(f"http://{address}/metrics")
        entries.append({"targets": [address], "labels": {"job": "sluice", "process": child.name}})
    for child in children:
        if child.stage == GATEWAY:
            child.env["SLUICE_METRICS_PEERS"] = ",".join(peers)
    targets.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = targets.with_name(f".{targets.name}.tmp")
    partial.write_text(json.dumps(entries, indent=2) + "\n")
    partial.replace(targets)  # Prometheus never reads half a file
    logger.info("metrics targets of %d processes in %s", len(entries), targets)


def readiness_urls(children: Sequence[Child], gateway_address: str) -> list[list[str]]:
    """What `up` polls before it says it serves: the gateway's /readyz, and for each pool
    with workers any one engine worker's /readyz on its metrics port (which
    `assign_metrics_ports` gave it)."""
    pools: dict[str | None, list[str]] = {}
    for child in children:
        if child.stage == ENGINE and "SLUICE_METRICS_PORT" in child.env:
            url = f"http://127.0.0.1:{child.env['SLUICE_METRICS_PORT']}/readyz"
            pools.setdefault(child.pool, []).append(url)
    return [[f"http://{gateway_address}/readyz"], *pools.values()]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # refused, or an HTTPError (503 while it loads)
        return False


def call_when_ready(
    groups: Sequence[Sequence[str]],
    then: Callable[[], None],
    stopped: threading.Event,
    poll_s: float = 0.5,
) -> threading.Thread:
    """Call `then` (on a thread of its own) once, for each group, one of its URLs answers
    200; never if `stopped` is set first."""

    def watch() -> None:
        while not stopped.wait(poll_s):
            if all(any(_answers(url) for url in group) for group in groups):
                then()
                return

    thread = threading.Thread(target=watch, name="sluice-up-ready", daemon=True)
    thread.start()
    return thread


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sluice_argv(*args: str) -> list[str]:
    """The command line that runs `sluice ARGS` with this interpreter."""
    return [sys.executable, "-m", "sluice", *args]


def engine_worker_env(engine_workers: int, env: Mapping[str, str]) -> dict[str, str]:
    """What an engine worker adds to the shared `env`: with several workers on this host,
    one engine process each unless SLUICE_ENGINE_REPLICAS says otherwise (its default,
    `sluice.wiring.resolve_engine_replicas`, counts on the host's cores for one worker)."""
    if engine_workers == 1 or "SLUICE_ENGINE_REPLICAS" in env:
        return {}
    return {"SLUICE_ENGINE_REPLICAS": "1"}


@dataclass(frozen=True, slots=True)
class EnginePool:
    """The engine workers of one model: `args` to `sluice worker engine`, and how many
    (0: none start; its requests wait in its topics for a worker started elsewhere)."""

    name: str
    args: Sequence[str]
    workers: int


def run_up(
    gateway_args: Sequence[str],
    pools: Sequence[EnginePool],
    kafka_bootstrap: str | None,
    restart: bool = True,
    extra: Sequence[tuple[str, Sequence[str]]] = (),
    gateway_env: Mapping[str, str] | None = None,
    tansu_bin: Path | None = None,
    metrics_targets: Path | None = None,
    gateway_address: str | None = None,
    engine_drain_timeout_s: float = 30.0,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Run the stack until Ctrl-C/SIGTERM; returns the exit code.

    `pools`: the engine workers per model; with one pool they are named
    `engine-worker-<i>`, with several `engine-worker-<pool>-<i>`.
    `extra`: more children as (name, `sluice` arguments), e.g. ("billing", ["worker",
    "billing"]). `gateway_env`: the gateway's own variables (its keys: SLUICE_API_KEYS).
    `tansu_bin`: the broker's binary when one is started (None: `tansu_binary()`'s default).
    `metrics_targets`: where to write the Prometheus targets of every child
    (`assign_metrics_ports`), `gateway_address` (host:port) being the gateway's.
    `engine_drain_timeout_s`: the engine workers' drain timeout, which their stop timeout
    (SIGKILL past it) exceeds. `on_ready`: called once the gateway and an engine worker
    are ready (their /readyz), so a request would be answered.
    """
    env = dict(os.environ)
    broker: TansuBroker | None = None
    if not kafka_bootstrap:
        broker = TansuBroker(binary=tansu_bin, own_process_group=True).start()
        kafka_bootstrap = broker.bootstrap
        logger.info("no SLUICE_KAFKA_BOOTSTRAP: started Tansu on %s", kafka_bootstrap)
        # Tansu's round trip grows with a partition's size
        logger.warning(
            "this Tansu keeps every message in memory and slows down as a partition grows "
            "(a gateway's reply topic takes up to ~100 messages/s while streaming): fine for "
            "trying Sluice out, not for long runs; set SLUICE_KAFKA_BOOTSTRAP for those"
        )
    env["SLUICE_KAFKA_BOOTSTRAP"] = kafka_bootstrap
    children = [
        Child("gateway", sluice_argv("gateway", *gateway_args), dict(gateway_env or {}), GATEWAY)
    ]
    engine_workers = sum(pool.workers for pool in pools)
    children += [
        Child(
            f"engine-worker-{i}" if len(pools) == 1 else f"engine-worker-{pool.name}-{i}",
            sluice_argv("worker", "engine", *pool.args),
            engine_worker_env(engine_workers, env),
            stage=ENGINE,
            stop_timeout_s=engine_drain_timeout_s + ENGINE_STOP_AFTER_DRAIN_S,
            pool=pool.name,
        )
        for pool in pools
        for i in range(pool.workers)
    ]
    children += [Child(name, sluice_argv(*args)) for name, args in extra]
    if metrics_targets is not None and gateway_address is not None:
        assign_metrics_ports(children, gateway_address, metrics_targets)
    supervisor = Supervisor(children, env, restart=restart)
    stopped = threading.Event()
    if on_ready is not None and gateway_address is not None:
        call_when_ready(readiness_urls(children, gateway_address), on_ready, stopped)

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        return supervisor.run()
    finally:
        stopped.set()
        if broker is not None:
            started = time.monotonic()
            code = broker.stop()
            logger.info("stopped broker: exit %s in %.1fs", code, time.monotonic() - started)
