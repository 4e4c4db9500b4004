"""Serving commands: `serve` (embedded), `gateway`, `worker engine|billing|quotas|batches|
batches-beat`, `up`.

Every serving command takes the same model flags; `up` passes them on to the processes
it starts, whose command lines are the equivalent `sluice gateway …`,
`sluice worker engine …`, `sluice worker billing`, `sluice worker quotas`,
`sluice worker batches …` and `sluice worker batches-beat`.

Keys: with a tenant store (always in `serve`; with SLUICE_DATABASE_URL in `gateway`)
callers use tenant keys (`sluice tenants create`) and are admitted against their plan.
The static key (`--api-key`, SLUICE_API_KEYS, or the generated one) is accepted, as
tenant "default" without limits, only while the store holds no tenant. Without a tenant
store (`gateway` with no SLUICE_DATABASE_URL) the static keys are the only keys.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from sluice.cli_common import (
    CONTEXT_SETTINGS,
    key_file,
    read_key,
    secure_data_dir,
    settings_or_exit,
)
from sluice.cli_common import DataDir as DataDir  # re-exported: `bulk` takes it from here
from sluice.settings import EngineWorkerSettings, GatewaySettings, Settings, SettingsError

if TYPE_CHECKING:
    from sluice.storage.db import Database
    from sluice.up import EnginePool

logger = logging.getLogger(__name__)

worker_app = typer.Typer(
    help="Processes that run behind the bus.",
    no_args_is_help=True,
    context_settings=CONTEXT_SETTINGS,
)

# None means "as the settings say" (SLUICE_* or their default), which show_default names
Host = Annotated[
    str | None,
    typer.Option(help="Address to listen on; overrides $SLUICE_HOST.", show_default="127.0.0.1"),
]
Port = Annotated[
    int | None,
    typer.Option(help="Port to listen on; overrides $SLUICE_PORT.", show_default="8000"),
]
Model = Annotated[
    str | None,
    typer.Option(
        help="A preset (smollm2-135m-instruct, tiny-llama), a Hugging Face model directory"
        " or a .gguf file; overrides $SLUICE_MODEL.",
        show_default="smollm2-135m-instruct",
    ),
]
Models = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        help="A preset (smollm2-135m-instruct, tiny-llama), a Hugging Face model directory"
        " or a .gguf file; overrides $SLUICE_MODEL. Repeat it to serve several models (the"
        " first also takes --served-model-name; the others: $SLUICE_MODELS).",
        show_default="smollm2-135m-instruct",
    ),
]
ServedName = Annotated[
    str | None,
    typer.Option(
        "--served-model-name",
        help="The model name clients use.",
        show_default="the model's name",
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option(
        help="auto (bf16 on CUDA, fp32 on CPU), float32 or bfloat16.", show_default="auto"
    ),
]
ApiKey = Annotated[
    str | None, typer.Option("--api-key", help="The bearer key to accept (generated if unset).")
]
Backend = Annotated[
    str | None,
    typer.Option(
        help="The engine: 'torch', 'sim' (a modelled GPU: $SLUICE_SIM_PRESET, no weights,"
        " almost no CPU) or 'upstream' (OpenAI-compatible engine servers: --upstream-url);"
        " overrides $SLUICE_BACKEND.",
        show_default="torch",
    ),
]
UpstreamUrl = Annotated[
    list[str] | None,
    typer.Option(
        "--upstream-url",
        metavar="URL",
        help="An engine server (vLLM, trtllm-serve, SGLang, sluice serve) for --backend"
        " upstream, which it implies; its URL (a trailing /v1 is dropped); repeat for"
        " several; overrides $SLUICE_UPSTREAM_URLS.",
        show_default=False,
    ),
]

Lora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="NAME=PATH[@BASE]",
        help="A LoRA adapter to serve as model NAME: the PEFT directory PATH, on BASE (a"
        " served model; default the first); repeat for several; overrides"
        " $SLUICE_LORA_MODULES.",
        show_default=False,
    ),
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


def _models_overrides(
    models: list[str] | None,
    served_model_name: str | None,
    dtype: str | None,
    data_dir: Path | None,
) -> dict[str, Any]:
    """`--model` repeated: the first is the model, the rest SLUICE_MODELS."""
    first, *rest = models or [""]
    overrides = _model_overrides(first or None, served_model_name, dtype, data_dir)
    return {**overrides, "models": ",".join(rest) if rest else None}


def _engine(backend: str | None, urls: list[str] | None) -> dict[str, Any]:
    """The backend flags as settings: `--upstream-url` alone means `--backend upstream`
    (a URL given to the torch engine would be ignored without a word)."""
    if urls and backend is None:
        backend = "upstream"
    return {"backend": backend, "upstream_urls": ",".join(urls) if urls else None}


TINY_LLAMA = "tiny-llama"  # the preset (engine.loader.PRESETS), named without importing torch
TINY_LLAMA_NOTICE = (
    "tiny-llama has random weights: replies are gibberish; "
    "serve a real model with --model /path/to/hf-dir"
)


def _keys(api_key: str | None, settings: GatewaySettings) -> GatewaySettings:
    """--api-key wins; else SLUICE_API_KEYS; else the key kept in `<data_dir>/api_key`
    (generated on the first start), so clients keep working across restarts."""
    if api_key:
        return settings.model_copy(update={"api_keys": [api_key]})
    if settings.api_keys:
        return settings
    return settings.model_copy(update={"api_keys": [_stored_key(key_file(settings))]})


def _stored_key(path: Path) -> str:
    """The key in `path` (made owner-only if it was not); a new one written there (0600)
    when it is missing or empty."""
    key = read_key(path)
    if key is None:
        key = f"sk-sluice-{secrets.token_urlsafe(24)}"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{key}\n")
    if stat.S_IMODE(path.stat().st_mode) != 0o600:
        path.chmod(0o600)  # it is a credential: an existing file may have the umask's mode
    return key


def _announce(
    settings: GatewaySettings, model_names: str, mode: str, tenant_db: Database | None = None
) -> None:
    """`model_names`: as the line names them ('a', 'b')."""
    url = f"http://{settings.host}:{settings.port}/v1"
    typer.echo(f"sluice {mode}: serving {model_names} at {url}")
    if settings.model == TINY_LLAMA:
        typer.echo(TINY_LLAMA_NOTICE)
    if tenant_db is not None:
        from sluice.billing.admin import has_tenants

        if has_tenants(tenant_db):
            typer.echo("tenant keys only: the tenant store has tenants (sluice tenants list)")
            return
    # stdout once, for the person starting it; never through logging (log files persist)
    key, path = settings.api_keys[0], key_file(settings)
    kept = f" (kept in {path}, reused on every start)" if read_key(path) == key else ""
    typer.echo(f"api key: {key}{kept}")
    typer.echo(f'try: curl {url}/models -H "Authorization: Bearer <api key>"')


def _report_startup(
    server: Any,
    app: Any,
    workers: Sequence[Any],
    backends: Sequence[Any],
    announce: Callable[[], None],
) -> None:
    """`serve`'s start-up lines (a thread): progress on stderr while the engines load, then
    `announce` once a request would be answered: `/readyz`'s checks (HTTP server up, reply
    consumer running, every engine worker ready). Polled: these flags come with no event."""
    started = time.monotonic()
    said_pid = said_down = False
    while True:
        if not all(worker.health() for worker in workers):
            typer.echo("sluice serve: an engine worker stopped before it was ready", err=True)
            return
        pids = [
            pid
            for backend in backends
            for pid in getattr(backend, "pids", None) or [getattr(backend, "pid", None)]
        ]
        if None not in pids and not said_pid:
            listed = ",".join(map(str, pids))
            typer.echo(f"sluice serve: engine process pid={listed} started, loading", err=True)
            said_pid = True
        probe, service = app.state.worker_probe, app.state.gateway.service
        down = probe.unavailable()
        if down is not None and not said_down:  # an upstream that does not answer, say
            typer.echo(f"sluice serve: {down}; requests answer 503 until it is up", err=True)
            said_down = True
        if server.started and service.ready and probe.ready():
            took_s = time.monotonic() - started
            said = "engines" if len(workers) > 1 else "engine"
            typer.echo(f"sluice serve: {said} ready after {took_s:.1f}s", err=True)
            announce()
            return
        time.sleep(0.1)


def _listen(settings: GatewaySettings, command: str) -> socket.socket:
    """The gateway's socket, bound before anything loads: a port in use is one line at
    once, not a traceback after the model has loaded."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        typer.echo(
            f"sluice {command}: cannot listen on {settings.host}:{settings.port}: "
            f"{exc.strerror or exc}; stop what holds it or pick another port "
            "(--port, $SLUICE_PORT)",
            err=True,
        )
        raise typer.Exit(1) from exc
    return sock


def _uvicorn(
    app: Any,
    settings: GatewaySettings,
    sock: socket.socket,
    watch: Callable[[Any], None] | None = None,
) -> None:
    """Serve on `sock` until SIGTERM/SIGINT, then return (so the caller can drain and exit
    0). `watch(server)` runs on a thread of its own meanwhile.

    uvicorn's own handlers re-raise the signal after shutdown, which would kill the
    process before the engine worker drains; ours only ask the server to exit.
    """
    from sluice.http_server import build_server

    server = build_server(app, settings)
    if watch is not None:
        threading.Thread(target=watch, args=(server,), name="sluice-startup", daemon=True).start()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %s: shutting down the gateway", signum)
        server.should_exit = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.run(sockets=[sock])


def serve(
    host: Host = None,
    port: Port = None,
    model: Models = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    api_key: ApiKey = None,
    backend: Backend = None,
    upstream_url: UpstreamUrl = None,
    lora: Lora = None,
) -> None:
    """Run everything in one process on the in-memory bus (embedded mode): an engine
    worker per model, each with its own engine."""
    from sluice import wiring
    from sluice.bus.memory import MemoryEventBus

    overrides = _models_overrides(model, served_model_name, dtype, data_dir)
    settings = settings_or_exit(
        GatewaySettings, host=host, port=port, lora_modules=lora, **overrides
    )
    worker_settings = settings_or_exit(
        EngineWorkerSettings, **_engine(backend, upstream_url), **overrides
    )
    each = wiring.each_model(worker_settings)
    if len(each) > 1 and worker_settings.engine_replicas is None:
        # the models' engines share the host's cores already: one process each
        each = [s.model_copy(update={"engine_replicas": 1}) for s in each]
    try:
        wiring.check_engines_fit(each)
    except SettingsError as exc:
        typer.echo(f"sluice serve: {exc}", err=True)
        raise typer.Exit(2) from exc
    sock = _listen(settings, "serve")
    secure_data_dir(settings)  # before a model download creates it with the umask's mode
    switch_metrics(settings)
    gateway = _keys(api_key, settings)
    names = ", ".join(repr(s.model_name) for s in each)
    typer.echo(f"sluice serve: loading {names}; the URL and key follow once it answers", err=True)
    bus = MemoryEventBus()
    bus.create_topics(wiring.topic_layout(gateway).specs())
    engines: list[Any] = []
    workers: list[Any] = []
    for one in each:
        options = wiring.engine_options(one)
        wiring.apply_process_effects(one, options)
        engine = wiring.build_backend(one, options)
        worker = wiring.build_worker(one, bus, engine)
        name = f"sluice-engine-worker-{len(workers)}"
        threading.Thread(target=worker.run, name=name, daemon=True).start()
        engines.append(engine)
        workers.append(worker)
    admission = wiring.open_tenancy(gateway, embedded=True)
    # the tracing consumer runs only when spans are exported (nothing slowed otherwise)
    exported = configure_process_tracing("sluice")
    consumers = wiring.ConsumerThreads(bus, admission, tracing=exported).start()
    # the engines' tokenizers when they loaded them (torch, sim, upstream); else read again
    served = wiring.served_models(gateway, [getattr(e, "tokenizer", None) for e in engines])
    batches = wiring.in_process_batches(
        gateway,
        bus,
        served,
        admission.auth.db,
        recover_on_start=True,
        engine_ready=wiring.WorkerProbe(workers).ready,
        admission=admission,
    ).start()
    app = wiring.build_gateway_app(gateway, bus, served, admission, batches=batches)
    # the URL and key only once a request would be answered, not while the model loads
    announce = functools.partial(_announce, gateway, names, "serve", admission.auth.db)
    watch = functools.partial(
        _report_startup, app=app, workers=workers, backends=engines, announce=announce
    )
    wiring.freeze_heap()
    try:
        _uvicorn(app, gateway, sock, watch)
    finally:
        batches.stop()
        for worker in workers:
            worker.drain(worker_settings.drain_timeout_s)
        consumers.stop()
        admission.close()


def gateway(
    host: Host = None,
    port: Port = None,
    model: Models = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    api_key: ApiKey = None,
    lora: Lora = None,
    announce: Annotated[
        bool, typer.Option(hidden=True, help="Print the URL and key (`up` says them itself).")
    ] = True,
) -> None:
    """Run the HTTP gateway on Kafka (distributed mode): it routes each request to the pool
    of its model (--model repeated, or $SLUICE_MODELS)."""
    from sluice import wiring

    overrides = _models_overrides(model, served_model_name, dtype, data_dir)
    settings = settings_or_exit(
        GatewaySettings, host=host, port=port, lora_modules=lora, **overrides
    )
    settings = _keys(api_key, settings)
    _require_kafka(settings)
    sock = _listen(settings, "gateway")
    secure_data_dir(settings)  # its tenants are the data dir's without SLUICE_DATABASE_URL
    switch_metrics(settings)
    configure_process_tracing("sluice-gateway")
    # a request the gateway answered 503 for (not published in time) is never published
    bus = wiring.make_bus(
        settings, client_id="sluice-gateway", message_timeout_s=settings.publish_timeout_s
    )
    admission = wiring.open_tenancy(settings, embedded=False)
    served = wiring.served_models(settings)
    batches = wiring.gateway_batches(settings, bus, served, admission)
    app = wiring.build_gateway_app(settings, bus, served, admission, batches=batches)
    if announce:
        names = ", ".join(repr(m.name) for m in served)
        _announce(settings, names, "gateway", admission.auth.db)
    wiring.freeze_heap()
    try:
        _uvicorn(app, settings, sock)
    finally:
        wiring.stop_batches(batches)
        bus.close()
        admission.close()


@worker_app.command("engine")
def worker_engine(
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    backend: Backend = None,
    upstream_url: UpstreamUrl = None,
) -> None:
    """Run one engine worker on Kafka: pull requests, run the engine, publish tokens."""
    from sluice import wiring
    from sluice.tracing.metrics import set_probes

    overrides = _model_overrides(model, served_model_name, dtype, data_dir)
    settings = settings_or_exit(EngineWorkerSettings, **_engine(backend, upstream_url), **overrides)
    _require_kafka(settings)
    bus = wiring.make_bus(settings, client_id="sluice-engine-worker")
    configure_process_tracing("sluice-engine")  # its hot path makes no spans (telemetry)
    serve_metrics(settings, ready_later=True)
    options = wiring.engine_options(settings)
    wiring.apply_process_effects(settings, options)
    worker = wiring.build_worker(settings, bus, wiring.build_backend(settings, options))
    probe = wiring.WorkerProbe([worker])
    set_probes(healthy=probe.healthy, ready=probe.ready)  # on the metrics port
    if not settings.redis_url:
        logger.warning(
            "SLUICE_REDIS_URL is unset: progress stays in this process, so a request whose "
            "partition moves to another worker runs again from the start under the same "
            "attempt (its client gets every token, but the usage of the first run may not "
            "be billed); set it whenever more than one engine worker runs"
        )

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
    from sluice import wiring
    from sluice.consumers.billing import billing_loop
    from sluice.consumers.loop import run_until_signalled

    settings = settings_or_exit(Settings, data_dir=data_dir)
    _require_kafka(settings)
    secure_data_dir(settings)
    bus = wiring.make_bus(settings, client_id="sluice-billing")
    configure_process_tracing("sluice-billing")
    serve_metrics(settings)
    ledger = wiring.billing_store(settings)
    try:
        run_until_signalled(billing_loop(bus, ledger))
    finally:
        bus.close()
        ledger.db.close()


@worker_app.command("quotas")
def worker_quotas(data_dir: DataDir = None) -> None:
    """Run the quotas consumer on Kafka: usage records → quota settlement in Redis."""
    from sluice import wiring
    from sluice.consumers.loop import run_until_signalled
    from sluice.consumers.quotas import quotas_loop

    settings = settings_or_exit(Settings, data_dir=data_dir)
    _require_kafka(settings)
    if not settings.redis_url:
        typer.echo("the quotas worker settles in Redis: set SLUICE_REDIS_URL", err=True)
        raise typer.Exit(2)
    secure_data_dir(settings)
    bus = wiring.make_bus(settings, client_id="sluice-quotas")
    configure_process_tracing("sluice-quotas")
    serve_metrics(settings)
    settler = wiring.quota_settler(settings)
    try:
        run_until_signalled(quotas_loop(bus, settler))
    finally:
        bus.close()
        settler.quotas.close()


@worker_app.command("tracing")
def worker_tracing(data_dir: DataDir = None) -> None:
    """Run the tracing consumer on Kafka: telemetry records → engine-side spans (OTLP).

    Exits at once (status 0) when no span exporter is configured: it would build spans
    for nobody, and `sluice up` starts it only when one is."""
    from sluice import wiring
    from sluice.consumers.loop import run_until_signalled
    from sluice.consumers.tracing.handler import tracing_loop

    settings = settings_or_exit(Settings, data_dir=data_dir)
    if not configure_process_tracing("sluice-tracing"):
        typer.echo(
            "sluice worker tracing: no span exporter is configured, nothing to do "
            "(set OTEL_EXPORTER_OTLP_ENDPOINT=http://host:4318, or OTEL_TRACES_EXPORTER)",
            err=True,
        )
        return
    _require_kafka(settings)
    bus = wiring.make_bus(settings, client_id="sluice-tracing")
    serve_metrics(settings)
    try:
        run_until_signalled(tracing_loop(bus))
    finally:
        bus.close()


@worker_app.command("batches")
def worker_batches(
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
) -> None:
    """Run the batch steps on Kafka: a Celery worker and the batch answers' collector.

    Celery runs validate, dispatch, finalize, cancel and sweep; the collector stores the
    engine's answers to batch lines. Needs SLUICE_DATABASE_URL and a Celery broker.
    """
    from sluice import wiring
    from sluice.consumers.batches.tasks import QUEUE

    overrides = _model_overrides(model, served_model_name, dtype, data_dir)
    # the runner builds a line's requests as the gateway builds them, with its limits
    settings = settings_or_exit(GatewaySettings, **overrides)
    _require_kafka(settings)
    _require_batch_services(settings, "batches worker")
    bus = wiring.make_bus(settings, client_id="sluice-batches")
    serve_metrics(settings)
    parts = wiring.batch_worker(settings, bus)
    collector_failed = threading.Event()

    def collect() -> None:
        try:
            parts.collector.run()
        except Exception:
            logger.exception("the batches collector failed")
            # exit, so that `sluice up` (or whoever supervises this) starts a fresh one
            collector_failed.set()
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=collect, name="sluice-batches-collector", daemon=True)
    thread.start()
    # Celery's worker owns SIGTERM/SIGINT here: a warm shutdown lets running steps end
    worker = parts.app.Worker(
        hostname=f"batches@{socket.gethostname()}-{os.getpid()}",
        pool="threads",
        concurrency=2,
        loglevel=settings.log_level,
        queues=[QUEUE],
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
        quiet=True,
        redirect_stdouts=False,
    )
    try:
        worker.start()
    finally:
        parts.collector.stop()  # it stores what it finished, then commits
        thread.join(30.0)
        logger.info("batches worker stopped: %d lines stored", parts.collector.lines_stored)
        parts.app.close()
        bus.close()
        parts.db.close()
    if collector_failed.is_set() or worker.exitcode:
        raise typer.Exit(1)


@worker_app.command("batches-beat")
def worker_batches_beat(data_dir: DataDir = None) -> None:
    """Run Celery beat: the batch sweep every SLUICE_BATCH_SWEEP_S (run exactly one).

    The sweep expires batches past their window, finalizes finished ones and reruns the
    steps of batches whose task was lost.
    """
    from sluice import wiring

    settings = settings_or_exit(Settings, data_dir=data_dir)
    if not settings.celery_broker:
        typer.echo(_NO_BROKER.format(what="batches beat"), err=True)
        raise typer.Exit(2)
    schedule = settings.data_dir.expanduser() / "batches-beat-schedule"
    schedule.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    app = wiring.celery_app(settings)
    serve_metrics(settings)  # only the process's own metrics: `up` scrapes every child
    # beat's own SIGTERM/SIGINT handlers save its schedule and return from run()
    beat = app.Beat(
        schedule=str(schedule), loglevel=settings.log_level, quiet=True, redirect_stdouts=False
    )
    try:
        beat.run()
    finally:
        app.close()


def up(
    host: Host = None,
    port: Port = None,
    model: Models = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    api_key: ApiKey = None,
    engine_workers: Annotated[
        int, typer.Option(min=1, help="Engine worker processes per model (see --pool).")
    ] = 1,
    pool: Annotated[
        list[str] | None,
        typer.Option(
            "--pool",
            metavar="MODEL=N",
            help="N engine workers for this model (its served name), repeatable; 0 starts"
            " none: its requests wait in its topics until a worker starts.",
            show_default=False,
        ),
    ] = None,
    restart: Annotated[bool, typer.Option(help="Restart a child that dies.")] = True,
) -> None:
    """Run the distributed stack as local processes: gateway, N engine workers, billing
    (and quotas, with SLUICE_REDIS_URL; the batches worker and its beat, with
    SLUICE_DATABASE_URL and a Celery broker; the tracing worker, when the OTEL_*
    variables export spans).

    Uses SLUICE_KAFKA_BOOTSTRAP, or starts a Tansu broker when it is unset.
    """
    from sluice import wiring
    from sluice.up import run_up

    overrides = _models_overrides(model, served_model_name, dtype, data_dir)
    settings = _keys(api_key, settings_or_exit(GatewaySettings, host=host, port=port, **overrides))
    each = wiring.each_model(settings)
    pools = _pools(each, engine_workers, pool or [], dtype=dtype, data_dir=data_dir)
    model_flags = _flags(
        model=settings.model, served_model_name=served_model_name, dtype=dtype, data_dir=data_dir
    )
    gateway_flags = [
        *model_flags,
        *(flag for s in each[1:] for flag in ("--model", s.model)),
        *_flags(host=settings.host, port=settings.port),
        "--no-announce",
    ]
    # the keys go in the gateway's environment: a command line is readable in `ps`
    gateway_env = {"SLUICE_API_KEYS": ",".join(settings.api_keys)}
    _migrate_data_dir_store(settings)
    counts = ", ".join(f"{p.name}: {p.workers}" for p in pools)
    total = sum(p.workers for p in pools)
    mode = f"up ({total} engine worker{'s' if total != 1 else ''}"
    mode += f"; {counts})" if len(pools) > 1 else ")"
    typer.echo(f"sluice {mode}: starting; the URL and key follow once it answers", err=True)

    def announce() -> None:
        with _tenant_store(settings) as tenant_db:
            _announce(settings, ", ".join(repr(s.model_name) for s in each), mode, tenant_db)

    code = run_up(
        gateway_flags,
        pools,
        settings.kafka_bootstrap,
        restart,
        _side_workers(settings, model_flags, _flags(data_dir=data_dir)),
        gateway_env=gateway_env,
        tansu_bin=settings.tansu_bin,
        metrics_targets=settings.data_dir.expanduser() / METRICS_TARGETS_FILE,
        gateway_address=f"{_local(settings.host)}:{settings.port}",
        engine_drain_timeout_s=settings_or_exit(EngineWorkerSettings).drain_timeout_s,
        on_ready=announce,
    )
    raise typer.Exit(code)


def _pools(
    each: Sequence[Settings],
    engine_workers: int,
    sizes: Sequence[str],
    *,
    dtype: str | None,
    data_dir: Path | None,
) -> list[EnginePool]:
    """The engine pools of `up`: one per model, `engine_workers` each unless `--pool
    MODEL=N` says otherwise."""
    from sluice.up import EnginePool

    names = [s.model_name for s in each]
    counts = dict.fromkeys(names, engine_workers)
    for item in sizes:
        name, sep, count = item.rpartition("=")
        if not sep or name not in counts or not count.isdigit():
            typer.echo(
                f"sluice up: --pool {item!r}: write MODEL=N, MODEL one of {', '.join(names)}",
                err=True,
            )
            raise typer.Exit(2)
        counts[name] = int(count)
    pools = []
    for s in each:
        args = _flags(model=s.model, served_model_name=s.served_model_name, dtype=dtype)
        pools.append(
            EnginePool(s.model_name, [*args, *_flags(data_dir=data_dir)], counts[s.model_name])
        )
    return pools


def _migrate_data_dir_store(settings: Settings) -> None:
    """`up` without SLUICE_DATABASE_URL: the data dir's SQLite, whose tenants the gateway
    admits against and whose ledger the billing worker writes (`wiring.open_tenancy`,
    `wiring.billing_store`), migrated here, once, before the two open it at the same time.
    With SLUICE_DATABASE_URL, `sluice migrate` is the migration step."""
    if settings.database_url is not None:
        return
    from sluice.storage.db import Database, embedded_url

    secure_data_dir(settings)  # before SQLite creates it with the umask's mode
    Database.connect(embedded_url(settings.data_dir), migrate_if_needed=True).close()


@contextlib.contextmanager
def _tenant_store(settings: Settings) -> Iterator[Database]:
    """The store whose tenants the gateway admits against: SLUICE_DATABASE_URL's, else
    the data dir's SQLite (both migrated by now)."""
    from sluice.storage.db import Database, embedded_url

    db = Database.connect(settings.database_url or embedded_url(settings.data_dir))
    try:
        yield db
    finally:
        db.close()


METRICS_TARGETS_FILE = "metrics-targets.json"  # in the data dir: Prometheus' file_sd targets


def _local(host: str) -> str:
    """An address to reach a server listening on `host` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _side_workers(
    settings: Settings, model_flags: list[str], data_flags: list[str]
) -> list[tuple[str, list[str]]]:
    """`up`'s workers beside the gateway and the engine workers: (name, `sluice` args)."""
    workers = [("billing", ["worker", "billing", *data_flags])]
    if spans_exported():  # the OTEL_* variables ask for spans (tracing.setup)
        workers.append(("tracing", ["worker", "tracing", *data_flags]))
    if settings.redis_url:
        workers.append(("quotas", ["worker", "quotas", *data_flags]))
    if settings.database_url and settings.celery_broker:
        workers.append(("batches", ["worker", "batches", *model_flags]))
        workers.append(("batches-beat", ["worker", "batches-beat", *data_flags]))
    # else the gateway runs the batch steps itself (with a database; without, no batches)
    return workers


def _flags(**values: Any) -> list[str]:
    out: list[str] = []
    for name, value in values.items():
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def serve_metrics(settings: Settings, *, ready_later: bool = False) -> None:
    """A worker's Prometheus metrics on SLUICE_METRICS_PORT (`sluice up` gives each child
    one), served by a thread of its own; nothing when it is unset. Applies
    SLUICE_METRICS_ENABLED first (`switch_metrics`).

    `ready_later`: `/readyz` answers 503 until the caller's `set_probes`. An engine
    worker's replacement that said ready from its first moment let a rolling restart stop
    the next worker while the group was still rebalancing."""
    from sluice.tracing.metrics import set_probes, start_metrics_server

    switch_metrics(settings)
    if ready_later:
        set_probes(healthy=lambda: True, ready=lambda: False)
    start_metrics_server(settings.metrics_port, settings.metrics_host)


def switch_metrics(settings: Settings) -> None:
    """SLUICE_METRICS_ENABLED=false: nothing is counted or observed in this process
    (`tracing.metrics.set_enabled`); applied before any worker or consumer starts."""
    from sluice.tracing.metrics import set_enabled

    set_enabled(settings.metrics_enabled)


def configure_process_tracing(service_name: str) -> bool:
    """This process's spans, exported as the OTEL_* variables ask; False: none are."""
    from sluice.tracing.setup import configure_tracing

    return configure_tracing(service_name) is not None


def spans_exported() -> bool:
    from sluice.tracing.setup import spans_exported as exported

    return exported()


def _require_kafka(settings: Settings) -> None:
    if not settings.kafka_bootstrap:
        typer.echo(
            "this command runs on Kafka: set SLUICE_KAFKA_BOOTSTRAP=host:port "
            "(or use `sluice serve` for one process, `sluice up` to start a broker too)",
            err=True,
        )
        raise typer.Exit(2)


_NO_BROKER = (
    "the {what} needs a Celery broker: set SLUICE_CELERY_BROKER_URL (or SLUICE_REDIS_URL, "
    "which it defaults to), e.g. redis://127.0.0.1:6379/0"
)


def _require_batch_services(settings: Settings, what: str) -> None:
    if not settings.database_url:
        typer.echo(
            f"the {what} keeps batches in PostgreSQL: set SLUICE_DATABASE_URL "
            "(and run `sluice migrate` once)",
            err=True,
        )
        raise typer.Exit(2)
    if not settings.celery_broker:
        typer.echo(_NO_BROKER.format(what=what), err=True)
        raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(gateway)
    app.command()(up)
    app.add_typer(worker_app, name="worker")
