"""Builds the running parts from settings: bus, engine backend, worker, gateway app.

The composition root (DESIGN.md §2): embedded mode and distributed mode run the same
gateway, engine worker and consumer code; only the adapters chosen here differ.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from api.app import create_app
from api.served import ServedModel
from billing.admission import AdmissionService, open_admission
from billing.ledger import UsageLedger
from bus.base import EventBus, TopicPartition
from bus.kafka import KafkaConfig, KafkaEventBus
from bus.memory import MemoryEventBus
from bus.topics import USAGE_TOPIC, TopicLayout
from consumers.billing import billing_loop
from consumers.engine_worker import EngineWorker, EngineWorkerConfig
from consumers.loop import ConsumeLoop
from consumers.progress import MemoryProgressStore, ProgressStore, RedisProgressStore
from consumers.quotas import quotas_loop
from engine.cpus import pin_process, plan_layout
from sluice.settings import EngineWorkerSettings, GatewaySettings, ModelSettings, Settings

logger = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Take what startup built (model, tokenizer, app, clients) out of the collector's way.

    A full (generation 2) collection walks every tracked object. With torch, the tokenizer
    and the pydantic models loaded, one took 245 ms in the benchmark's gateway process (as
    240 streams started) and 60-170 ms in an engine worker, stalling every stream of the
    process at once: the slowest interactive TTFTs of a `bench serving` priority run were
    221 ms against a p50 of 30. `gc.freeze()` moves every object alive now to a permanent
    generation that collections skip; what requests allocate later is collected as before.
    """
    gc.collect()
    gc.freeze()


def topic_layout(settings: Settings) -> TopicLayout:
    return TopicLayout(
        request_partitions=settings.request_partitions,
        tokens_partitions=settings.tokens_partitions,
        usage_partitions=settings.usage_partitions,
    )


def make_bus(settings: Settings, client_id: str) -> EventBus:
    """Kafka when `SLUICE_KAFKA_BOOTSTRAP` is set, else the in-memory bus; topics created."""
    bus: EventBus
    if settings.kafka_bootstrap:
        bus = KafkaEventBus(KafkaConfig(bootstrap=settings.kafka_bootstrap, client_id=client_id))
    else:
        bus = MemoryEventBus()
    bus.create_topics(topic_layout(settings).specs())
    return bus


def resolve_device(settings: ModelSettings) -> str:
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(settings: ModelSettings, device: str) -> str:
    """auto: bfloat16 on CUDA, float32 on CPU (exact, and not slower on CPUs without bf16)."""
    if settings.dtype != "auto":
        return settings.dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def model_dir(settings: Settings) -> Path:
    from engine.loader import resolve_model_dir

    return resolve_model_dir(settings.model, settings.data_dir)


def served_max_model_len(settings: Settings, path: Path) -> int:
    """The engine's limit, capped by what the checkpoint's positions allow."""
    config = json.loads((path / "config.json").read_text())
    positions = int(config.get("max_position_embeddings") or settings.max_model_len)
    return min(settings.max_model_len, positions)


def served_model(settings: Settings, tokenizer: Any | None = None) -> ServedModel:
    """The model as the gateway serves it; loads only the tokenizer when none is given."""
    from engine.tokenizer import Tokenizer

    path = model_dir(settings)
    if tokenizer is None:
        tokenizer = Tokenizer.from_dir(path)
    return ServedModel(
        name=settings.model_name,
        max_model_len=served_max_model_len(settings, path),
        tokenizer=tokenizer,
    )


def resolve_torch_threads(settings: ModelSettings, device: str) -> int | None:
    """SLUICE_TORCH_THREADS; unset: on CPU every core this process may use but one.

    The engine shares the host with the Kafka client threads, the broker and the
    gateway; with a thread on every core its steps wait for whichever core they took.
    Measured with `bench serving --quick` on 2-core VMs: the pipeline's tok/s at 80 req/s
    was 0.65x the direct engine's with 2 threads, 0.86x with 1 (AVX-512 VM); 0.67-0.76x
    vs 0.88x (AVX2 VM); after the move to librdkafka (AVX-512 VM, two runs each)
    0.70-0.85x vs 0.74-0.86x. None: leave torch's default (CUDA: host threads matter little).
    """
    if settings.torch_threads is not None:
        return settings.torch_threads
    if device != "cpu":
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def build_backend(settings: Settings) -> Any:
    """Sluice's torch engine on the configured model, device and dtype: in a process of
    its own (`engine.backends.process_backend`), or a thread of this one."""
    from engine.config import EngineConfig

    device = resolve_device(settings)
    threads = resolve_torch_threads(settings, device)
    path = model_dir(settings)
    config = EngineConfig(
        device=device,
        dtype=resolve_dtype(settings, device),
        kv_cache_mb=settings.kv_cache_mb,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=served_max_model_len(settings, path),
        # the worker maps lanes to priorities (consumers.worker_requests.LANE_PRIORITY);
        # only this policy honours them, and preempts batch work for interactive
        scheduling_policy="priority",
    )
    backend: Any
    if settings.engine_process:
        from engine.backends.process_backend import EngineSpec, ProcessEngineBackend

        spec = EngineSpec(path, config, settings.data_dir, settings.quantization, threads)
        backend = ProcessEngineBackend(spec)  # loads the model as it starts
    else:
        from engine.backends.torch_backend import TorchEngineBackend

        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        backend = TorchEngineBackend.from_model(
            path, config=config, data_dir=settings.data_dir, quantization=settings.quantization
        )
    layout = plan_layout(settings.engine_cpus, threads or 1) if device == "cpu" else None
    if layout is not None:
        # this process's threads now (the bus clients', the gateway's) and those they
        # start go to the other cores; the engine (its thread, or its process) moves to
        # its own as it starts
        pin_process(layout.rest)
        backend.thread_cpus = layout.engine
        logger.info("%s", layout.describe())
    return backend


def progress_store(settings: Settings) -> ProgressStore:
    """Redis when configured (workers in other processes can resume), else in-process."""
    if settings.redis_url:
        ttl = getattr(settings, "progress_ttl_s", 6 * 3600)
        return RedisProgressStore(settings.redis_url, ttl_s=ttl)
    return MemoryProgressStore()


def worker_id(settings: EngineWorkerSettings) -> str:
    return settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def build_worker(settings: EngineWorkerSettings, bus: EventBus, backend: Any) -> EngineWorker:
    return EngineWorker(
        bus,
        backend,
        EngineWorkerConfig(**settings.worker_config_kwargs()),
        progress_store(settings),
        worker_id(settings),
    )


def build_gateway_app(
    settings: GatewaySettings,
    bus: EventBus,
    model: ServedModel,
    admission: AdmissionService | None = None,
) -> Any:
    return create_app(settings, bus, [model], admission=admission)


def open_tenancy(settings: GatewaySettings, *, embedded: bool) -> AdmissionService | None:
    """The tenant store and quota store the gateway admits against.

    Embedded (`sluice serve`): the data dir's SQLite (migrated on first use; or
    SLUICE_DATABASE_URL) and the in-process quota store. Distributed (`sluice gateway`):
    only with SLUICE_DATABASE_URL (else static keys, no admission), quotas in Redis when
    SLUICE_REDIS_URL is set (in-process otherwise: per gateway, not shared).
    """
    if not embedded and not settings.database_url:
        return None
    if not embedded and not settings.redis_url:
        logger.warning("no SLUICE_REDIS_URL: quota limits are per gateway process")
    return open_admission(
        database_url=settings.database_url,
        redis_url=None if embedded else settings.redis_url,
        data_dir=settings.data_dir,
        fallback_replicas=settings.gateway_replicas,
    )


def billing_store(settings: Settings) -> UsageLedger:
    """The ledger the billing consumer writes: SLUICE_DATABASE_URL, else the data dir's SQLite."""
    from billing.db import Database, embedded_url

    url = settings.database_url or embedded_url(settings.data_dir)
    return UsageLedger(Database.connect(url, migrate_if_needed=settings.database_url is None))


def quota_settler(settings: Settings) -> Any:
    """The quotas consumer's settler on Redis (SLUICE_REDIS_URL is required)."""
    from billing.admission import UsageSettler
    from billing.db import Database, embedded_url
    from billing.prices import PriceBook, PriceCache
    from billing.quota_redis import RedisQuotaStore

    if not settings.redis_url:
        raise ValueError("the quotas worker needs SLUICE_REDIS_URL")
    url = settings.database_url or embedded_url(settings.data_dir)
    db = Database.connect(url, migrate_if_needed=settings.database_url is None)
    return UsageSettler(RedisQuotaStore(settings.redis_url), PriceCache(PriceBook(db)))


class ConsumerThreads:
    """The billing and quotas consumers as threads of `sluice serve` (memory bus)."""

    def __init__(self, bus: EventBus, admission: AdmissionService) -> None:
        self.bus = bus
        self.loops: list[ConsumeLoop] = [
            billing_loop(bus, UsageLedger(admission.auth.db)),
            quotas_loop(bus, admission.settler),
        ]
        self.threads = [
            threading.Thread(target=loop.run, name=f"sluice-{loop.group_id}", daemon=True)
            for loop in self.loops
        ]

    def start(self) -> ConsumerThreads:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Let them catch up with the usage topic (memory bus), then stop them."""
        end_offset = getattr(self.bus, "end_offset", None)
        deadline = time.monotonic() + drain_timeout_s
        if end_offset is not None:
            partitions = range(self.bus.num_partitions(USAGE_TOPIC))
            total = sum(end_offset(TopicPartition(USAGE_TOPIC, p)) for p in partitions)
            while time.monotonic() < deadline and any(
                loop.stats.handled < total for loop in self.loops
            ):
                time.sleep(0.05)
        for loop in self.loops:
            loop.stop()
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()) + 2.0)
