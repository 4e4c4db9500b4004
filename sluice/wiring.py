"""Builds the running parts from settings: bus, engine backend, worker, gateway app.

The composition root (DESIGN.md §2): embedded mode and distributed mode run the same
gateway, engine worker and consumer code; only the adapters chosen here differ.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from api.app import create_app
from api.served import ServedModel
from bus.base import EventBus
from bus.kafka import KafkaConfig, KafkaEventBus
from bus.memory import MemoryEventBus
from bus.topics import TopicLayout
from consumers.engine_worker import EngineWorker, EngineWorkerConfig
from consumers.progress import MemoryProgressStore, ProgressStore, RedisProgressStore
from sluice.settings import EngineWorkerSettings, GatewaySettings, ModelSettings, Settings

logger = logging.getLogger(__name__)


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


def build_backend(settings: Settings) -> Any:
    """Sluice's torch engine on the configured model, device and dtype."""
    from engine.backends.torch_backend import TorchEngineBackend
    from engine.config import EngineConfig

    device = resolve_device(settings)
    path = model_dir(settings)
    config = EngineConfig(
        device=device,
        dtype=resolve_dtype(settings, device),
        kv_cache_mb=settings.kv_cache_mb,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=served_max_model_len(settings, path),
    )
    return TorchEngineBackend.from_model(
        path, config=config, data_dir=settings.data_dir, quantization=settings.quantization
    )


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


def build_gateway_app(settings: GatewaySettings, bus: EventBus, model: ServedModel) -> Any:
    return create_app(settings, bus, [model])
