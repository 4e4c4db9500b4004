"""Settings, built once at start-up from `SLUICE_*` variables and passed down.

One class per process kind, composed of shared parts (STYLE.md). Bad values fail at
start-up with a message that names the variable, the value and the fix.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "SLUICE_"


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
    request_partitions: int = Field(default=6, ge=1, le=1024)
    tokens_partitions: int = Field(default=6, ge=1, le=1024)
    usage_partitions: int = Field(default=3, ge=1, le=1024)

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

    model: str = Field(default="tiny-llama", description="'tiny-llama' or a HF model directory")
    served_model_name: str | None = Field(default=None, description="default: the model's name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(default=2048, ge=16, description="prompt + output tokens")
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    kv_cache_mb: float = Field(default=256.0, gt=0)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=16)
    quantization: Literal["int8"] | None = None
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="intra-op threads of the engine; unset: on CPU all cores but one (a"
        " core left to the Kafka clients, broker and gateway), elsewhere torch's default",
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

    @property
    def model_name(self) -> str:
        """The name clients use: --served-model-name, else the preset or directory name."""
        return self.served_model_name or Path(self.model).name


class Settings(CommonSettings, BusSettings, StoreSettings, ModelSettings):
    """What every Sluice process reads; process kinds extend it."""


S = TypeVar("S", bound=_Base)


def load_settings(cls: type[S] = Settings, **overrides: Any) -> S:  # type: ignore[assignment]
    """Build settings from the environment plus explicit overrides (CLI flags)."""
    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(describe(exc)) from exc


def describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        var = f"{ENV_PREFIX}{field.upper()}"
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"{var}={error.get('input')!r} is invalid: {message}")
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
    gateway_replicas: int = Field(
        default=1,
        ge=1,
        description="gateway processes sharing Redis: each takes limit/replicas when it is down",
    )
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
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

    @field_validator("api_keys", mode="before")
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
    max_engine_waiting: int = Field(default=8, ge=1)
    max_kv_usage: float = Field(default=0.9, gt=0, le=1.0)
    max_in_engine: int = Field(default=128, ge=1)
    cancel_ttl_s: float = Field(default=600.0, gt=0)
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
        from bus.topics import Lane

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
            "max_kv_usage": self.max_kv_usage,
            "max_in_engine": self.max_in_engine,
            "cancel_ttl_s": self.cancel_ttl_s,
            "drain_timeout_s": self.drain_timeout_s,
            "reply_interval_s": self.reply_interval_ms / 1000,
        }
