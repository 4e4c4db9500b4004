"""The whole tenancy flow in one process: gateways → bus → engine worker → billing/quotas.

Real parts throughout: N gateway apps (each with its own `AdmissionService`, on uvicorn
loopback servers), the real `EngineWorker` over the deterministic `FakeEngineBackend`
(gated, so a test can hold every admitted request in flight), the billing and quotas
consumers, and a tap that keeps every `UsageRecord` the engine published.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.faults_infra import TcpProxy
from sluice.api.app import create_app
from sluice.billing.admission import AdmissionService
from sluice.bus.codec import decode_as
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC, TopicLayout, pool_id
from sluice.consumers.billing import billing_loop
from sluice.consumers.engine_worker import EngineWorkerConfig
from sluice.consumers.loop import ConsumeLoop
from sluice.consumers.quotas import quotas_loop
from sluice.engine.backends.base import EngineDelta
from sluice.storage.db import Database
from sluice.storage.keys import KeyAuthenticator
from sluice.storage.ledger import UsageLedger
from sluice.storage.prices import PriceBook, PriceCache
from sluice.storage.quotas import QuotaStore
from tests.unit.api.conftest import gateway_settings
from tests.unit.api.fakes import ServerThread, served_model
from tests.unit.consumers.engine_fakes import FakeEngineBackend
from tests.unit.consumers.engine_harness import WorkerThread
from tests.waiting import wait_until

MODEL = "tiny"


class GatedBackend(FakeEngineBackend):
    """Generates nothing until `gate` is set (aborts and deadlines still end requests)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def step(self) -> list[EngineDelta]:
        if self.gate.is_set():
            return super().step()
        return []


class UsageTap:
    """Every UsageRecord on the usage topic (its own consumer group)."""

    def __init__(self, bus: MemoryEventBus) -> None:
        self.records: list[UsageRecord] = []
        self._consumer = bus.consumer(f"tap-{uuid.uuid4().hex[:8]}", [USAGE_TOPIC])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for record in self._consumer.poll(0.05, 500):
                self.records.append(decode_as(UsageRecord, record.value))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


@dataclass
class Stack:
    bus: MemoryEventBus
    db: Database
    backend: GatedBackend
    worker: WorkerThread
    tap: UsageTap
    loops: list[ConsumeLoop]
    services: list[AdmissionService]
    servers: list[ServerThread]
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
        wait_until(predicate, timeout_s, what or "the condition")

    def close(self) -> None:
        for server in self.servers:
            server.__exit__(None, None, None)
        self.backend.gate.set()
        self.worker.stop(10.0)
        for loop in self.loops:
            loop.stop()
        for thread in self.threads:
            thread.join(5)
        self.tap.close()
        for service in self.services:
            service.quotas.close()
        self.bus.close()


def start_stack(
    db: Database,
    make_quotas: Callable[[], QuotaStore],
    *,
    gateways: int = 1,
    **settings: Any,
) -> Stack:
    """`gateways` apps on one memory bus, each with its own quota store from `make_quotas`."""
    bus = MemoryEventBus()
    layout = TopicLayout(request_partitions=2, tokens_partitions=1, pools=(pool_id(MODEL),))
    bus.create_topics(layout.specs())
    backend = GatedBackend(step_s=0.003, max_running=64)
    config = EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01, max_engine_waiting=256)
    worker = WorkerThread(bus, backend, config, pool=pool_id(MODEL)).start()
    tap = UsageTap(bus)
    services = [
        AdmissionService(KeyAuthenticator(db), make_quotas(), PriceCache(PriceBook(db), ttl_s=0.5))
        for _ in range(gateways)
    ]
    loops = [billing_loop(bus, UsageLedger(db)), quotas_loop(bus, services[0].settler)]
    threads = [threading.Thread(target=loop.run, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()
    values = {"api_keys": [], **settings}
    servers = [
        ServerThread(
            create_app(
                gateway_settings(**values),
                bus,
                [served_model(MODEL, max_model_len=4096)],
                admission=svc,
            )
        ).__enter__()
        for svc in services
    ]
    return Stack(bus, db, backend, worker, tap, loops, services, servers, threads)


class RedisProxy(TcpProxy):
    """A TCP proxy in front of Redis; `cut()` is the outage (listener and links closed)."""

    def __init__(self, upstream_port: int = 6379) -> None:
        super().__init__(upstream_port)
