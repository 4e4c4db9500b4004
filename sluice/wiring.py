"""Builds the running parts from settings: bus, engine backend, worker, gateway app.

The composition root (docs/architecture.md §2): embedded mode and distributed mode run the same
gateway, engine worker and consumer code; only the adapters chosen here differ.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sluice.api.app import create_app, model_catalog, request_limits
from sluice.api.routes.batches import BatchLimits
from sluice.api.served import ServedModel
from sluice.billing.admission import AdmissionService, open_admission
from sluice.billing.batch_budget import BatchBudget
from sluice.bus.base import EventBus, TopicPartition, TopicSpec
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import USAGE_TOPIC, TopicLayout, pool_id, reply_topic
from sluice.consumers.batches.collector import BatchCollector
from sluice.consumers.batches.lines import BATCH_REPLY_TARGET
from sluice.consumers.batches.runner import BatchConfig, BatchRunner
from sluice.consumers.batches.tasks import CeleryBatches, InProcessBatches, bind_runner, make_celery
from sluice.consumers.billing import billing_loop
from sluice.consumers.engine_worker import EngineWorker
from sluice.consumers.loop import ConsumeLoop
from sluice.consumers.progress import MemoryProgressStore, ProgressStore, RedisProgressStore
from sluice.consumers.quotas import quotas_loop
from sluice.consumers.tracing.handler import tracing_loop
from sluice.engine.cpus import CpuLayout, available_cpus, pin_process, plan_layout
from sluice.engine.options import EngineOptions, apply_switch_interval
from sluice.settings import (
    EngineWorkerSettings,
    GatewaySettings,
    ModelSettings,
    Settings,
    SettingsError,
)
from sluice.settings_fields import config_kwargs
from sluice.storage.batches import BatchStore
from sluice.storage.db import Database, embedded_url
from sluice.storage.ledger import UsageLedger
from sluice.storage.streams import RedisStreamDirectory

if TYPE_CHECKING:
    from celery import Celery

    from sluice.engine.backends.process_backend import ProcessEngineBackend
    from sluice.engine.backends.replicated import ReplicatedBackend
    from sluice.engine.backends.sim_backend import SimEngineBackend
    from sluice.engine.backends.torch_backend import TorchEngineBackend
    from sluice.engine.backends.trtllm_backend import TrtllmEngineBackend
    from sluice.engine.backends.upstream_backend import UpstreamEngineBackend

logger = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Take what startup built (model, tokenizer, app, clients) out of the collector's way.

    A full (generation 2) collection walks every tracked object; with torch, the tokenizer
    and the pydantic models loaded it stalls every stream of the process at once for tens
    to hundreds of ms. `gc.freeze()` moves every object alive now to
    a permanent generation that collections skip; what requests allocate later is
    collected as before.
    """
    gc.collect()
    gc.freeze()


S = TypeVar("S", bound=ModelSettings)


def each_model(settings: S) -> list[S]:
    """The settings of each model the deployment serves: --model's, then one copy per
    SLUICE_MODELS entry naming that model (served under its own name)."""
    extra = [
        settings.model_copy(update={"model": m, "served_model_name": None, "models": []})
        for m in settings.models
    ]
    return [settings, *extra]


def topic_layout(settings: Settings) -> TopicLayout:
    """The topics, with the request lanes of every served model's pool."""
    pools = tuple(pool_id(s.model_name) for s in each_model(settings))
    return TopicLayout(**config_kwargs(settings, TopicLayout), pools=pools)


def make_bus(
    settings: Settings, client_id: str, message_timeout_s: float | None = None
) -> EventBus:
    """Kafka when `SLUICE_KAFKA_BOOTSTRAP` is set, else the in-memory bus; topics created.

    `message_timeout_s`: what the producer did not deliver by then fails, never goes later.
    """
    bus: EventBus
    if settings.kafka_bootstrap:
        timeout_ms = None if message_timeout_s is None else int(message_timeout_s * 1000)
        config = KafkaConfig(
            bootstrap=settings.kafka_bootstrap,
            client_id=client_id,
            message_timeout_ms=timeout_ms,
            fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
        )
        bus = KafkaEventBus(config)
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
    """auto: bfloat16 on CUDA and on CPUs that multiply bf16 in hardware (AVX512-BF16,
    AMX), whose decode is bound by reading the weights: half the bytes of float32. Other
    CPUs keep float32: they emulate bf16 matmuls, slower than float32 runs."""
    if settings.dtype != "auto":
        return settings.dtype
    if device.startswith("cuda"):
        return "bfloat16"
    import torch

    from sluice.engine.models.cpu_linear import native_low_precision

    return "bfloat16" if native_low_precision(torch.bfloat16) else "float32"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # a checkpoint's weight files


def model_dir(settings: Settings) -> Path:
    """The configured model's path (a preset's, created on first use): a Hugging Face
    directory or a GGUF file. A model that is not there, or that the engine cannot run,
    raises SettingsError in one line (`sluice.cli.main` prints it, no traceback)."""
    from sluice.engine.loader import ModelLoadError, resolve_model_dir
    from sluice.engine.model_files import ModelFilesError, model_config

    try:
        path = resolve_model_dir(settings.model, settings.data_dir)
        model_config(path)  # a missing config.json, or a GGUF the engine cannot run
    except (ModelLoadError, ModelFilesError, OSError, ValueError) as exc:
        raise SettingsError(f"SLUICE_MODEL (--model) {settings.model!r}: {exc}") from exc
    return path


def served_max_model_len(settings: Settings, path: Path) -> int:
    """The engine's limit, capped by what the checkpoint's positions allow."""
    from sluice.engine.model_files import model_config

    config = model_config(path)
    positions = int(config.get("max_position_embeddings") or settings.max_model_len)
    return min(settings.max_model_len, positions)


def served_model(settings: Settings, tokenizer: Any | None = None) -> ServedModel:
    """The model as the gateway serves it; loads only the tokenizer when none is given.
    Output constraints are checked with the engine's own grammar compiler."""
    from sluice.engine.model_files import load_tokenizer
    from sluice.engine.sampling import Constraint
    from sluice.engine.structured import GrammarCompiler

    path = model_dir(settings)
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    grammars = GrammarCompiler(tokenizer)
    return ServedModel(
        name=settings.model_name,
        max_model_len=served_max_model_len(settings, path),
        tokenizer=tokenizer,
        tool_parser=settings.tool_parser,
        reasoning_parser=settings.reasoning_parser,
        check_constraint=lambda kind, value: grammars.check(Constraint(kind, value)),
    )


def served_models(settings: Settings, tokenizers: Sequence[Any | None] = ()) -> list[ServedModel]:
    """Every model the gateway serves (`each_model`), each with its tokenizer; `tokenizers`:
    those already loaded, by position (None: load it)."""
    models = each_model(settings)
    loaded = [*tokenizers, *[None] * (len(models) - len(tokenizers))]
    return [served_model(s, t) for s, t in zip(models, loaded, strict=True)]


def resolve_torch_threads(settings: ModelSettings, device: str) -> int | None:
    """SLUICE_TORCH_THREADS; unset: on CPU every core this process may use but one.

    The engine shares the host with the Kafka client threads, the broker and the
    gateway; with a thread on every core its steps wait for whichever core they took.
    None: leave torch's default (CUDA: host threads matter little).
    """
    if settings.torch_threads is not None:
        return settings.torch_threads
    if device != "cpu":
        return None
    return max(1, _usable_cores() - 1)


def resolve_prefill_threads(settings: ModelSettings, device: str) -> int | None:
    """SLUICE_PREFILL_THREADS; unset: on CPU every core this process may use, unless the
    engine's threads or cores were chosen (SLUICE_TORCH_THREADS, SLUICE_ENGINE_CPUS).

    The core left to the rest by `resolve_torch_threads` idles through most of a prefill:
    a step of many tokens is long enough to share it.
    """
    if settings.prefill_threads is not None:
        return settings.prefill_threads
    if device != "cpu" or settings.torch_threads is not None or settings.engine_cpus:
        return None
    cores = _usable_cores()
    return cores if cores > 1 else None


def resolve_engine_replicas(settings: ModelSettings, device: str) -> int:
    """SLUICE_ENGINE_REPLICAS for the torch engine in processes of its own; unset: on CPU,
    when the engine's threads and cores are not chosen (SLUICE_TORCH_THREADS,
    SLUICE_PREFILL_THREADS, SLUICE_ENGINE_CPUS), 2 on a host of 2 cores or more whose
    memory holds both model copies with room to spare, else 1.

    Two single-threaded engines on 2 cores outrun one engine with prefill threads at a
    burst: neither waits for a thread that lost its core to the gateway
    (`engine.backends.replicated`).
    """
    if not settings.engine_process or settings.backend != "torch":
        return 1
    if settings.engine_replicas is not None:
        return settings.engine_replicas
    chosen = settings.torch_threads, settings.prefill_threads, settings.engine_cpus
    if device != "cpu" or any(c is not None for c in chosen):
        return 1
    if _usable_cores() < 2 or not _copies_fit(Path(settings.model), 2):
        return 1
    return 2


def _copies_fit(model: Path, copies: int) -> bool:
    """`copies` of the checkpoint at `model` within a quarter of the host's memory; a
    preset's (a name, not a path) is small."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return copies * _weights_in_memory(model) <= memory / 4


def _weights_in_memory(model: Path) -> int:
    """Bytes the checkpoint at `model` may take loaded: its files, perhaps widened to fp32
    (x2); a GGUF's weights de-quantize to fp32 (up to x8 of a 4-bit file); 0 for what is
    not a path."""
    if model.is_file() and model.suffix == ".gguf":
        return model.stat().st_size * 8
    if model.is_dir():
        files = [f for f in model.iterdir() if f.suffix in WEIGHT_SUFFIXES]
        return sum(f.stat().st_size * (8 if f.suffix == ".gguf" else 2) for f in files)
    return 0


def check_engines_fit(models: Sequence[Settings]) -> None:
    """Refuse at start, with the figures, engines for `models` (each replica a copy of its
    weights and its KV cache) that would not fit in the memory this host has available."""
    if len(models) < 2:
        return  # one model: its load says so itself, as it always did
    need: list[tuple[str, int]] = []
    for settings in models:
        if settings.backend != "torch":
            continue
        replicas = resolve_engine_replicas(settings, resolve_device(settings))
        weights = _weights_in_memory(model_dir(settings))
        need.append((settings.model_name, replicas * (weights + int(settings.kv_cache_mb * 2**20))))
    total = sum(n for _, n in need)
    available = _available_memory()
    if available is not None and total > available:
        each = ", ".join(f"{name} {n / 2**30:.1f} GiB" for name, n in need)
        raise SettingsError(
            f"the engines of {len(need)} models need about {total / 2**30:.1f} GiB ({each});"
            f" this host has {available / 2**30:.1f} GiB available: serve fewer or smaller"
            " models, or run them as engine workers on other hosts (`sluice up`)"
        )


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def engine_options(settings: ModelSettings) -> EngineOptions:
    """The engine's runtime options from the settings: torch threads and cores are for
    the configured device (on CPU only, see `resolve_torch_threads` and SLUICE_ENGINE_CPUS)."""
    if settings.backend == "sim":  # nothing to compute: no torch threads, no engine cores
        return settings.engine_options(None, None)
    device = resolve_device(settings)
    replicas = resolve_engine_replicas(settings, device)
    if replicas > 1:  # all cores but one shared between them (at least one each), unpinned
        share = settings.torch_threads or max(1, (_usable_cores() - 1) // replicas)
        return settings.engine_options(share, None, settings.prefill_threads)
    threads = resolve_torch_threads(settings, device)
    layout = plan_layout(settings.engine_cpus, threads or 1) if device == "cpu" else None
    return settings.engine_options(
        threads,
        layout.engine if layout is not None else None,
        resolve_prefill_threads(settings, device),
    )


def apply_process_effects(settings: ModelSettings, options: EngineOptions) -> None:
    """The serving process's process-wide effects, once at start-up before the engine is
    built (the CLI calls it: this module is the composition root): the GIL switch
    interval; torch threads and the kernels when the engine runs in this process (its own
    process applies them to itself); with engine cores, this process's threads now and
    those they start later go to the other cores (the engine's thread, or its process,
    moves to its own as it starts)."""
    apply_switch_interval(options)
    if settings.backend == "upstream" and logger.getEffectiveLevel() > logging.DEBUG:
        # httpx logs every request at INFO: a line per health probe and per completion
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if settings.backend in ("sim", "upstream"):  # no torch, no engine cores here
        return
    if not settings.engine_process:
        from sluice.engine.backends.torch_backend import apply_process_options

        apply_process_options(options)
    if options.cpus:
        layout = CpuLayout(options.cpus, available_cpus() - options.cpus)
        pin_process(layout.rest)
        logger.info("%s", layout.describe())


def build_backend(
    settings: Settings, options: EngineOptions
) -> (
    TorchEngineBackend
    | ProcessEngineBackend
    | ReplicatedBackend
    | SimEngineBackend
    | UpstreamEngineBackend
    | TrtllmEngineBackend
):
    """Sluice's torch engine on the configured model, device and dtype, running as
    `options` say: in a process of its own (`engine.backends.process_backend`), or a
    thread of this one; with SLUICE_BACKEND=sim the modelled GPU of `sim_backend` instead.
    Applies nothing process-wide (`apply_process_effects` does)."""
    if settings.backend == "sim":
        return build_sim_backend(settings)
    if settings.backend == "upstream":
        return build_upstream_backend(settings)
    if settings.backend == "trtllm":
        return build_trtllm_backend(settings)
    device = resolve_device(settings)
    path = model_dir(settings)
    config = settings.engine_config(
        device=device,
        dtype=resolve_dtype(settings, device),
        max_model_len=served_max_model_len(settings, path),
        # the worker maps lanes to priorities (consumers.worker_requests.LANE_PRIORITY);
        # only this policy honours them, and preempts batch work for interactive
        scheduling_policy="priority",
    )
    if settings.engine_process:
        from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend

        spec = EngineSpec(path, config, settings.data_dir, settings.quantization, options)
        replicas = resolve_engine_replicas(settings, device)
        if replicas > 1:
            from sluice.engine.backends.replicated import ReplicatedBackend

            return ReplicatedBackend.of(spec, replicas)
        return ProcessEngineBackend(spec)  # loads the model as it starts
    from sluice.engine.backends.torch_backend import TorchEngineBackend

    return TorchEngineBackend.from_model(
        path,
        config=config,
        data_dir=settings.data_dir,
        quantization=settings.quantization,
        options=options,
    )


def build_sim_backend(settings: Settings) -> SimEngineBackend:
    """The sim backend for SLUICE_SIM_PRESET, serving the configured model's tokenizer and
    max_model_len (the gateway tokenizes as usual); SLUICE_MAX_NUM_SEQS,
    SLUICE_MAX_NUM_BATCHED_TOKENS and SLUICE_SIM_MIN_STEP_MS override the preset's only
    when set."""
    from sluice.engine.backends.sim_backend import SIM_PRESETS, SimEngineBackend
    from sluice.engine.model_files import load_tokenizer

    preset = SIM_PRESETS.get(settings.sim_preset)
    if preset is None:
        raise SettingsError(
            f"SLUICE_SIM_PRESET={settings.sim_preset!r} is not a sim preset; "
            f"use one of {', '.join(sorted(SIM_PRESETS))}"
        )
    shape: dict[str, object] = {
        name: getattr(settings, name)
        for name in ("max_num_seqs", "max_num_batched_tokens")
        if name in settings.model_fields_set
    }
    if settings.sim_min_step_ms:
        shape["min_step_ms"] = settings.sim_min_step_ms
    if shape:
        preset = preset.replace(**shape)
    path = model_dir(settings)
    return SimEngineBackend(
        preset,
        max_model_len=served_max_model_len(settings, path),
        tokenizer=load_tokenizer(path),
    )


def build_upstream_backend(settings: Settings) -> UpstreamEngineBackend:
    """The upstream backend over SLUICE_UPSTREAM_URLS; the gateway tokenizes with the
    configured model's tokenizer, which must be the upstream model's."""
    from sluice.engine.backends.upstream_backend import UpstreamEngineBackend
    from sluice.engine.model_files import load_tokenizer

    if not settings.upstream_urls:
        raise SettingsError(
            "SLUICE_BACKEND=upstream needs SLUICE_UPSTREAM_URLS: the engine servers' base"
            " URLs, comma-separated (e.g. http://10.0.0.5:8000)"
        )
    path = model_dir(settings)
    return UpstreamEngineBackend(
        settings.upstream_urls,
        settings.upstream_model,
        api_key=settings.upstream_api_key,
        max_model_len=served_max_model_len(settings, path),
        tokenizer=load_tokenizer(path),
        max_num_seqs=settings.max_num_seqs,
        dialect=settings.upstream_dialect,
        health_path=settings.upstream_health_path,
    )


def build_trtllm_backend(settings: Settings) -> TrtllmEngineBackend:
    """TensorRT-LLM's LLM API on the configured model directory (tiny-llama's preset
    included), loaded now: max_num_seqs, max_num_batched_tokens and max_model_len become
    its batch size, token budget and sequence length; SLUICE_TRTLLM_KV_CACHE_FRACTION its
    KV cache. SLUICE_DEVICE, SLUICE_DTYPE and SLUICE_KV_CACHE_MB do not apply."""
    from sluice.engine.backends.trtllm_backend import TrtllmEngineBackend

    path = model_dir(settings)
    try:
        return TrtllmEngineBackend.from_model_dir(
            path,
            max_model_len=served_max_model_len(settings, path),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_cache_fraction=settings.trtllm_kv_cache_fraction,
        )
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "tensorrt_llm":
            raise
        raise SettingsError(
            "SLUICE_BACKEND=trtllm needs TensorRT-LLM: pip install -e '.[trtllm]' on a"
            " machine with an NVIDIA GPU"
        ) from exc


def progress_store(settings: EngineWorkerSettings) -> ProgressStore:
    """Redis when configured (workers in other processes can resume), else in-process."""
    if settings.redis_url:
        return RedisProgressStore(settings.redis_url, ttl_s=settings.progress_ttl_s)
    return MemoryProgressStore()


def worker_id(settings: EngineWorkerSettings) -> str:
    return settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"


# The engine workers built on each bus of this process: embedded mode's gateway app,
# built on the same bus, answers its probes for them (`build_gateway_app`).
_workers_on_bus: weakref.WeakKeyDictionary[EventBus, list[EngineWorker]] = (
    weakref.WeakKeyDictionary()
)


def build_worker(settings: EngineWorkerSettings, bus: EventBus, backend: Any) -> EngineWorker:
    worker = EngineWorker(
        bus,
        backend,
        settings.worker_config(),
        progress_store(settings),
        worker_id(settings),
        pool=pool_id(settings.model_name),
        model_name=settings.model_name,  # the engine gauges' label
    )
    _workers_on_bus.setdefault(bus, []).append(worker)
    return worker


@dataclass(frozen=True, slots=True)
class WorkerProbe:
    """The engine workers of this process as `/readyz` and `/healthz` see them
    (`api.routes.health.WorkerProbe`)."""

    workers: Sequence[EngineWorker]

    def ready(self) -> bool:
        return all(w.stats.ready and w.health() for w in self.workers)

    def healthy(self) -> bool:
        return all(w.health() for w in self.workers)

    def unavailable(self) -> str | None:
        """The first worker's reason no engine is up (None: up, or loading)."""
        for worker in self.workers:
            message = worker.unavailable_message
            if message is None and not worker.health():
                message = "no engine is up: the engine worker stopped; see the server's log"
            if message is not None:
                return message
        return None


def build_gateway_app(
    settings: GatewaySettings,
    bus: EventBus,
    models: Sequence[ServedModel],
    admission: AdmissionService | None = None,
    workers: Sequence[EngineWorker] | None = None,
    batches: Any | None = None,
) -> Any:
    """The gateway's app; its probes include `workers` (default: those `build_worker`
    built on `bus` in this process, i.e. embedded mode's; none in distributed mode)."""
    app = create_app(settings, bus, models, admission=admission, batches=batches)
    app.state.metrics_peers = settings.metrics_peers  # the dashboard scrapes them too
    if workers is None:
        workers = _workers_on_bus.get(bus, [])
    if workers:
        app.state.worker_probe = WorkerProbe(list(workers))
    elif settings.redis_url:
        # a fleet's gateways share where their resumable streams run: a client whose
        # gateway died resumes its stream on another one
        streams = app.state.gateway.service.streams
        streams.directory = RedisStreamDirectory(settings.redis_url)
    return app


def open_tenancy(settings: GatewaySettings, *, embedded: bool) -> AdmissionService:
    """The tenant store and quota store the gateway admits against.

    Tenants: SLUICE_DATABASE_URL, else the data dir's SQLite (migrated on first use), the
    store `sluice tenants` and the billing worker use too, so `sluice up` and a lone
    `sluice gateway` never serve with a data dir's tenants ignored. Quotas: in-process
    when embedded (`sluice serve`); distributed (`sluice gateway`), in Redis when
    SLUICE_REDIS_URL is set (in-process otherwise: per gateway, not shared).
    """
    if not embedded and not settings.database_url:
        logger.warning(
            "no SLUICE_DATABASE_URL: tenants and keys are %s's, this host's only",
            embedded_url(settings.data_dir).removeprefix("sqlite:///"),
        )
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
    from sluice.storage.db import Database, embedded_url

    url = settings.database_url or embedded_url(settings.data_dir)
    return UsageLedger(Database.connect(url, migrate_if_needed=settings.database_url is None))


def quota_settler(settings: Settings) -> Any:
    """The quotas consumer's settler on Redis (SLUICE_REDIS_URL is required)."""
    from sluice.billing.admission import UsageSettler
    from sluice.storage.db import Database, embedded_url
    from sluice.storage.prices import PriceBook, PriceCache
    from sluice.storage.quota_redis import RedisQuotaStore

    if not settings.redis_url:
        raise ValueError("the quotas worker needs SLUICE_REDIS_URL")
    url = settings.database_url or embedded_url(settings.data_dir)
    db = Database.connect(url, migrate_if_needed=settings.database_url is None)
    return UsageSettler(RedisQuotaStore(settings.redis_url), PriceCache(PriceBook(db)))


class ConsumerThreads:
    """The billing and quotas consumers as threads of `sluice serve` (memory bus), and
    the tracing consumer when spans are exported (`tracing`; otherwise it is not started:
    nothing is built for nobody)."""

    def __init__(
        self, bus: EventBus, admission: AdmissionService, *, tracing: bool = False
    ) -> None:
        self.bus = bus
        self.loops: list[ConsumeLoop] = [
            billing_loop(bus, UsageLedger(admission.auth.db)),
            quotas_loop(bus, admission.settler),
        ]
        self.threads = [
            threading.Thread(target=loop.run, name=f"sluice-{loop.group_id}", daemon=True)
            for loop in self.loops
        ]
        # apart from `loops`: `stop` drains those up to the usage topic's end, not this one
        self.tracing = tracing_loop(bus) if tracing else None
        if self.tracing is not None:
            self.threads.append(
                threading.Thread(target=self.tracing.run, name="sluice-tracing", daemon=True)
            )

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
        for loop in [*self.loops, *([self.tracing] if self.tracing else [])]:
            loop.stop()
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()) + 2.0)


# -- batches (docs/architecture.md §14) ---------------------------------------------------
def batch_limits(settings: Settings) -> BatchLimits:
    return BatchLimits(
        max_file_bytes=settings.batch_max_file_bytes,
        max_lines=settings.batch_max_lines,
        window_s=settings.batch_window_s,
    )


def batch_runner(
    settings: GatewaySettings,
    bus: EventBus,
    models: Sequence[ServedModel],
    db: Database,
    admission: AdmissionService | None = None,
) -> BatchRunner:
    """The batch steps; with `admission`, batch lines keep to the tenants' budgets."""
    config = BatchConfig(
        max_lines=settings.batch_max_lines,
        queue_tokens=settings.batch_queue_tokens,
        grace_s=settings.batch_grace_s,
        lease_s=settings.batch_recover_s,
    )
    # the collector's topic (one partition, as it creates it) exists before a line goes
    # out: an engine answering first has the broker create it with its default partitions
    bus.create_topics([TopicSpec(reply_topic(BATCH_REPLY_TARGET), 1)])
    budget = BatchBudget(admission) if admission is not None else None
    # batch lines name models, aliases and LoRA adapters as requests do (the adapters
    # loaded at run time live in this database, as the gateways' do)
    catalog = model_catalog(settings, models, db)
    limits = request_limits(settings)
    return BatchRunner(BatchStore(db), bus, models, limits, config, budget, catalog)


def in_process_batches(
    settings: GatewaySettings,
    bus: EventBus,
    models: Sequence[ServedModel],
    db: Database,
    *,
    recover_on_start: bool,
    engine_ready: Callable[[], bool] | None = None,
    admission: AdmissionService | None = None,
) -> InProcessBatches:
    """Embedded mode's batches: tasks, collector and sweep as threads of this process.
    `recover_on_start`: the bus is in memory, so a restart publishes unfinished lines again."""
    runner = batch_runner(settings, bus, models, db, admission)
    return InProcessBatches(
        runner,
        batch_limits(settings),
        sweep_interval_s=settings.batch_sweep_s,
        recover_on_start=recover_on_start,
        engine_ready=engine_ready,
    )


def celery_app(settings: Settings) -> Celery:
    """The batch tasks' Celery app on `settings.celery_broker` (the caller checked it is set)."""
    assert settings.celery_broker, "no Celery broker: SLUICE_CELERY_BROKER_URL or SLUICE_REDIS_URL"
    return make_celery(settings.celery_broker, sweep_interval_s=settings.batch_sweep_s)


def gateway_batches(
    settings: GatewaySettings,
    bus: EventBus,
    models: Sequence[ServedModel],
    admission: AdmissionService | None,
) -> CeleryBatches | InProcessBatches | None:
    """The distributed gateway's `BatchControl`: batch steps go to Celery when a broker is
    set and SLUICE_DATABASE_URL names the database `sluice worker batches` shares;
    otherwise this gateway runs them itself, so batches work on a single gateway.

    In-process here never republishes on start: Kafka kept the queued lines and answers.
    """
    if admission is None:
        return None
    db = admission.auth.db
    if settings.celery_broker and settings.database_url:
        return CeleryBatches(celery_app(settings), BatchStore(db), batch_limits(settings))
    # `sluice worker batches` needs SLUICE_DATABASE_URL: on the data dir's SQLite, no worker
    logger.warning(
        "no Celery broker (SLUICE_CELERY_BROKER_URL or SLUICE_REDIS_URL) or no "
        "SLUICE_DATABASE_URL: this gateway runs the batch steps itself; run one such "
        "gateway, or set both and run `sluice worker batches`"
    )
    return in_process_batches(
        settings, bus, models, db, recover_on_start=False, admission=admission
    ).start()


def stop_batches(batches: CeleryBatches | InProcessBatches | None) -> None:
    if isinstance(batches, InProcessBatches):
        batches.stop()
    elif isinstance(batches, CeleryBatches):
        batches.app.close()  # its broker connections


@dataclass(frozen=True, slots=True)
class BatchWorker:
    """`sluice worker batches`: the Celery app with a `BatchRunner` bound, and the
    collector, whose finished batches go to the finalize task."""

    app: Celery
    collector: BatchCollector
    db: Database


def batch_worker(settings: GatewaySettings, bus: EventBus) -> BatchWorker:
    """Builds the batches worker on SLUICE_DATABASE_URL and the Celery broker (the caller
    checked both are set); the served model with its tokenizer only, no engine."""
    assert settings.database_url, "the batches worker needs SLUICE_DATABASE_URL"
    db = Database.connect(settings.database_url)
    # budgets need the gateways' quota store: Redis (without it each gateway keeps its own)
    admission = open_tenancy(settings, embedded=False) if settings.redis_url else None
    runner = batch_runner(settings, bus, served_models(settings), db, admission)
    app = celery_app(settings)
    bind_runner(app, runner)
    control = CeleryBatches(app, runner.store, batch_limits(settings))
    collector = BatchCollector(
        bus, runner.store, runner.models, control.batch_done, budget=runner.budget
    )
    return BatchWorker(app, collector, db)
