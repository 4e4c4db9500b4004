"""Serving commands: `serve` (embedded), `gateway`, `worker engine|billing|quotas`, `up`.

Every serving command takes the same model flags; `up` passes them on to the processes
it starts, whose command lines are the equivalent `sluice gateway …`,
`sluice worker engine …`, `sluice worker billing` and `sluice worker quotas`.

Keys: with a tenant store (always in `serve`; with SLUICE_DATABASE_URL in `gateway`)
callers use tenant keys (`sluice tenants create`) and are admitted against their plan.
The static key (`--api-key`, SLUICE_API_KEYS, or the generated one) is accepted, as
tenant "default" without limits, only while the store holds no tenant. Without a tenant
store (`gateway` with no SLUICE_DATABASE_URL) the static keys are the only keys.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from sluice.cli_common import settings_or_exit
from sluice.settings import EngineWorkerSettings, GatewaySettings, Settings

logger = logging.getLogger(__name__)

worker_app = typer.Typer(help="Processes that run behind the bus.", no_args_is_help=True)

Host = Annotated[str | None, typer.Option(help="Address to listen on [default: 127.0.0.1].")]
Port = Annotated[int | None, typer.Option(help="Port to listen on [default: 8000].")]
Model = Annotated[str | None, typer.Option(help="'tiny-llama' or a Hugging Face model directory.")]
ServedName = Annotated[
    str | None, typer.Option("--served-model-name", help="The model name clients use.")
]
Dtype = Annotated[
    str | None, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), float32 or bfloat16.")
]
DataDir = Annotated[Path | None, typer.Option(help="Where models and state live.")]
ApiKey = Annotated[
    str | None, typer.Option("--api-key", help="The bearer key to accept (generated if unset).")
]


def _model_overrides(
    model: str | None, served_model_name: str | None, dtype: str | None, data_dir: Path | None
) -> dict[str, Any]:
    return {
        "model": model,
        "served_model_name": served_model_name,
        "dtype": dtype,
        "data_dir": data_dir,
    }


def _keys(api_key: str | None, settings: GatewaySettings) -> GatewaySettings:
    """--api-key wins; else SLUICE_API_KEYS; else a generated key, printed once."""
    if api_key:
        return settings.model_copy(update={"api_keys": [api_key]})
    if settings.api_keys:
        return settings
    return settings.model_copy(update={"api_keys": [f"sk-sluice-{secrets.token_urlsafe(24)}"]})


def _announce(
    settings: GatewaySettings, model_name: str, mode: str, admission: Any | None = None
) -> None:
    url = f"http://{settings.host}:{settings.port}/v1"
    typer.echo(f"sluice {mode}: serving {model_name!r} at {url}")
    if admission is not None:
        from billing.admin import has_tenants

        if has_tenants(admission.auth.db):
            typer.echo("tenant keys only: the tenant store has tenants (sluice tenants list)")
            return
    typer.echo(f"api key: {settings.api_keys[0]}")
    typer.echo(f'try: curl {url}/models -H "Authorization: Bearer {settings.api_keys[0]}"')


def _uvicorn(app: Any, settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT, then return (so the caller can drain and exit 0).

    uvicorn's own handlers re-raise the signal after shutdown, which would kill the
    process before the engine worker drains; ours only ask the server to exit.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = _Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    )

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %s: shutting down the gateway", signum)
        server.should_exit = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.run()


def serve(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    api_key: ApiKey = None,
) -> None:
    """Run everything in one process on the in-memory bus (embedded mode)."""
    from bus.memory import MemoryEventBus
    from sluice import wiring

    overrides = _model_overrides(model, served_model_name, dtype, data_dir)
    gateway = _keys(api_key, settings_or_exit(GatewaySettings, host=host, port=port, **overrides))
    worker_settings = settings_or_exit(EngineWorkerSettings, **overrides)
    bus = MemoryEventBus()
    bus.create_topics(wiring.topic_layout(gateway).specs())
    backend = wiring.build_backend(worker_settings)
    worker = wiring.build_worker(worker_settings, bus, backend)
    thread = threading.Thread(target=worker.run, name="sluice-engine-worker", daemon=True)
    thread.start()
    admission = wiring.open_tenancy(gateway, embedded=True)
    assert admission is not None
    consumers = wiring.ConsumerThreads(bus, admission).start()
    served = wiring.served_model(gateway, backend.tokenizer)
    app = wiring.build_gateway_app(gateway, bus, served, admission)
    _announce(gateway, gateway.model_name, "serve", admission)
    wiring.freeze_heap()
    try:
        _uvicorn(app, gateway)
    finally:
        worker.drain(worker_settings.drain_timeout_s)
        consumers.stop()
        admission.close()


def gateway(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    api_key: ApiKey = None,
) -> None:
    """Run the HTTP gateway on Kafka (distributed mode)."""
    from sluice import wiring

    overrides = _model_overrides(model, served_model_name, dtype, data_dir)
    settings = _keys(api_key, settings_or_exit(GatewaySettings, host=host, port=port, **overrides))
    _require_kafka(settings)
    bus = wiring.make_bus(settings, client_id="sluice-gateway")
    admission = wiring.open_tenancy(settings, embedded=False)
    app = wiring.build_gateway_app(settings, bus, wiring.served_model(settings), admission)
    _announce(settings, settings.model_name, "gateway", admission)
    wiring.freeze_heap()
    try:
        _uvicorn(app, settings)
    finally:
        bus.close()
        if admission is not None:
            admission.close()


@worker_app.command("engine")
def worker_engine(
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
) -> None:
    """Run one engine worker on Kafka: pull requests, run the engine, publish tokens."""
    from sluice import wiring

    overrides = _model_overrides(model, served_model_name, dtype, data_dir)
    settings = settings_or_exit(EngineWorkerSettings, **overrides)
    _require_kafka(settings)
    bus = wiring.make_bus(settings, client_id="sluice-engine-worker")
    worker = wiring.build_worker(settings, bus, wiring.build_backend(settings))

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %s: draining engine worker", signum)
        worker.stop(settings.drain_timeout_s)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    wiring.freeze_heap()
    try:
        worker.run()
    finally:
        bus.close()


@worker_app.command("billing")
def worker_billing(data_dir: DataDir = None) -> None:
    """Run the billing consumer on Kafka: usage records → the usage ledger (SQL)."""
    from consumers.billing import billing_loop
    from consumers.loop import run_until_signalled
    from sluice import wiring

    settings = settings_or_exit(Settings, data_dir=data_dir)
    _require_kafka(settings)
    bus = wiring.make_bus(settings, client_id="sluice-billing")
    ledger = wiring.billing_store(settings)
    try:
        run_until_signalled(billing_loop(bus, ledger))
    finally:
        bus.close()
        ledger.db.close()


@worker_app.command("quotas")
def worker_quotas(data_dir: DataDir = None) -> None:
    """Run the quotas consumer on Kafka: usage records → quota settlement in Redis."""
    from consumers.loop import run_until_signalled
    from consumers.quotas import quotas_loop
    from sluice import wiring

    settings = settings_or_exit(Settings, data_dir=data_dir)
    _require_kafka(settings)
    if not settings.redis_url:
        typer.echo("the quotas worker settles in Redis: set SLUICE_REDIS_URL", err=True)
        raise typer.Exit(2)
    bus = wiring.make_bus(settings, client_id="sluice-quotas")
    settler = wiring.quota_settler(settings)
    try:
        run_until_signalled(quotas_loop(bus, settler))
    finally:
        bus.close()
        settler.quotas.close()


def up(
    host: Host = None,
    port: Port = None,
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    api_key: ApiKey = None,
    engine_workers: Annotated[int, typer.Option(min=1, help="Engine worker processes.")] = 1,
    restart: Annotated[bool, typer.Option(help="Restart a child that dies.")] = True,
) -> None:
    """Run the distributed stack as local processes: gateway, N engine workers, billing
    (and quotas, with SLUICE_REDIS_URL).

    Uses SLUICE_KAFKA_BOOTSTRAP, or starts a Tansu broker when it is unset.
    """
    from sluice.up import run_up

    overrides = _model_overrides(model, served_model_name, dtype, data_dir)
    settings = _keys(api_key, settings_or_exit(GatewaySettings, host=host, port=port, **overrides))
    model_flags = _flags(
        model=model, served_model_name=served_model_name, dtype=dtype, data_dir=data_dir
    )
    gateway_flags = [
        *model_flags,
        *_flags(host=settings.host, port=settings.port, api_key=settings.api_keys[0]),
    ]
    _announce(settings, settings.model_name, f"up ({engine_workers} engine workers)")
    data_flags = _flags(data_dir=data_dir)
    extra: list[tuple[str, list[str]]] = [("billing", ["worker", "billing", *data_flags])]
    if settings.redis_url:
        extra.append(("quotas", ["worker", "quotas", *data_flags]))
    code = run_up(
        gateway_flags, model_flags, engine_workers, settings.kafka_bootstrap, restart, extra
    )
    raise typer.Exit(code)


def _flags(**values: Any) -> list[str]:
    out: list[str] = []
    for name, value in values.items():
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def _require_kafka(settings: Settings) -> None:
    if not settings.kafka_bootstrap:
        typer.echo(
            "this command runs on Kafka: set SLUICE_KAFKA_BOOTSTRAP=host:port "
            "(or use `sluice serve` for one process, `sluice up` to start a broker too)",
            err=True,
        )
        raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(gateway)
    app.command()(up)
    app.add_typer(worker_app, name="worker")
