"""The gateway's FastAPI app factory: OpenAI-compatible routes over the event bus.

`create_app` wires what the composition root (`sluice/`) built: settings, the bus, the
served models, the authenticator, with a tenant store the `AdmissionService`, and with
a database the `BatchControl` behind the Files and Batches routes and, with the tenant
store's database, the `ResponseKeeper` behind stored and background responses. The
app starts the `GatewayService` (the reply consumer) in its lifespan and stops it on
shutdown; it does not close the admission service (its owner does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI

from sluice.api.auth import Authenticator, StaticKeyAuthenticator
from sluice.api.deps import Gateway
from sluice.api.errors import install_error_handlers
from sluice.api.middleware import GatewayMiddleware
from sluice.api.openapi import install_docs, install_openapi
from sluice.api.prepare import RequestLimits
from sluice.api.routes import (
    admin,
    chat,
    completions,
    dashboard,
    files,
    health,
    lora,
    responses,
    usage,
)
from sluice.api.routes import batches as batch_routes
from sluice.api.routes import metrics as metrics_routes
from sluice.api.routes import models as model_routes
from sluice.api.routes.batches import BatchControl
from sluice.api.served import LoraModule, ModelCatalog, ServedModel
from sluice.api.server_span import ServerSpanMiddleware
from sluice.api.service import GatewayService
from sluice.api.slo import SloPools
from sluice.api.stored_responses import ResponseKeeper
from sluice.api.tenancy import GatewayAdmission, TenantAuthenticator
from sluice.billing.admission import AdmissionService
from sluice.bus.base import EventBus
from sluice.bus.topics import Lane
from sluice.storage.adapters import AdapterStore
from sluice.storage.db import Database
from sluice.storage.responses import ResponseStore


class GatewayConfig(Protocol):
    """What the app reads of the gateway's settings (`sluice.settings.GatewaySettings`).

    A protocol rather than the settings class: the composition root imports the app, so
    the app importing the root's settings would close a cycle.
    """

    @property
    def gateway_id(self) -> str | None: ...
    @property
    def api_keys(self) -> Sequence[str]: ...
    @property
    def admin_key(self) -> str | None: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def publish_timeout_s(self) -> float: ...
    @property
    def deadline_grace_s(self) -> float: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def sse_ping_s(self) -> float: ...
    @property
    def stream_resume_window_s(self) -> float: ...
    @property
    def max_n(self) -> int: ...
    @property
    def max_choices(self) -> int: ...
    @property
    def max_logprobs(self) -> int: ...
    @property
    def max_messages(self) -> int: ...
    @property
    def max_content_parts(self) -> int: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def ws_max_pending(self) -> int: ...
    @property
    def ws_allowed_origins(self) -> Sequence[str]: ...
    @property
    def trace_content(self) -> bool: ...
    @property
    def slo_admission(self) -> bool: ...
    @property
    def model_aliases(self) -> Mapping[str, str]: ...
    @property
    def lora_modules(self) -> Sequence[str]: ...
    @property
    def adapter_refresh_s(self) -> float: ...
    @property
    def ttft_target_interactive_s(self) -> float: ...
    @property
    def ttft_target_standard_s(self) -> float: ...
    @property
    def response_retention_days(self) -> float: ...


def request_limits(settings: GatewayConfig) -> RequestLimits:
    """The limits on one request, for the routes and for batch lines alike."""
    return RequestLimits(
        request_timeout_s=settings.request_timeout_s,
        max_n=settings.max_n,
        max_choices=settings.max_choices,
        max_logprobs=settings.max_logprobs,
    )


def model_catalog(
    settings: GatewayConfig, models: Sequence[ServedModel], db: Database | None = None
) -> ModelCatalog:
    """The served models, their aliases and LoRA adapters (`--lora`, and with the tenant
    store's `db` those loaded at run time), for the routes and for batch lines alike."""
    return ModelCatalog(
        models,
        settings.model_aliases,
        [LoraModule.parse(m) for m in settings.lora_modules],
        AdapterStore(db) if db is not None else None,
        settings.adapter_refresh_s,
    )


def create_app(
    settings: GatewayConfig,
    bus: EventBus,
    models: Sequence[ServedModel],
    authenticator: Authenticator | None = None,
    *,
    service: GatewayService | None = None,
    admission: AdmissionService | None = None,
    batches: BatchControl | None = None,
) -> FastAPI:
    """The gateway app. `authenticator` defaults to the static keys of `settings`, or
    with `admission` to the tenant store (static keys then work only while it is empty).

    `service` may be passed in (tests, embedded mode); by default one is built on `bus`
    with `settings.gateway_id`. The app owns its lifecycle either way. Without `batches`
    the Files and Batches routes answer 503.
    """
    service = service or GatewayService(
        bus,
        gateway_id=settings.gateway_id,
        reply_partitions=1,
        publish_timeout_s=settings.publish_timeout_s,
        deadline_grace_s=settings.deadline_grace_s,
        heartbeat_s=settings.heartbeat_s,
        resume_window_s=settings.stream_resume_window_s,
    )
    catalog = model_catalog(settings, models, admission.auth.db if admission else None)
    if settings.slo_admission:
        service.slo = SloPools(
            {
                Lane.INTERACTIVE.value: settings.ttft_target_interactive_s,
                Lane.STANDARD.value: settings.ttft_target_standard_s,
            },
            catalog.pools,
        )
    limits = request_limits(settings)
    # stored responses live beside the tenants: every gateway on that database reads them
    keeper = None
    if admission is not None:
        retention_s = int(settings.response_retention_days * 86_400)
        keeper = ResponseKeeper(ResponseStore(admission.auth.db), service, retention_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if keeper is not None:
            await keeper.start()
        refresher = asyncio.create_task(catalog.refresh_forever(), name="adapter-registry")
        try:
            yield
        finally:
            refresher.cancel()
            if keeper is not None:
                await keeper.stop()
            await service.stop()

    app = FastAPI(
        title="Sluice",
        summary="OpenAI-compatible gateway of the Sluice inference pipeline",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # install_docs serves Swagger UI without a CDN
        redoc_url=None,
        # the server span is ours (api.server_span): it ends with the stream, carries the
        # usage and hands the GenAI operation to the engine side; FastAPI's would be a second
        telemetry={"tracing": False, "operation_spans": False},
    )
    static = StaticKeyAuthenticator(settings.api_keys)
    if admission is not None:
        authenticator = authenticator or TenantAuthenticator(admission, static)
    app.state.gateway = Gateway(
        service=service,
        models=catalog,
        limits=limits,
        sse_ping_s=settings.sse_ping_s,
        admission=GatewayAdmission(admission, service) if admission is not None else None,
        admin_key=settings.admin_key,
        ws_max_pending=settings.ws_max_pending,
        max_messages=settings.max_messages,
        max_content_parts=settings.max_content_parts,
    )
    app.state.authenticator = authenticator or static
    app.state.ws_allowed_origins = settings.ws_allowed_origins
    app.state.batches = batches
    app.state.responses = keeper
    install_error_handlers(app)
    v1 = (model_routes, chat, completions, responses, usage, files, batch_routes)
    for module in (health, *v1, admin, lora, dashboard):
        app.include_router(module.router)
    app.include_router(metrics_routes.router)  # /metrics, outside the API schema
    app.add_middleware(
        GatewayMiddleware,
        max_body_bytes=settings.max_body_bytes,
        max_upload_bytes=None if batches is None else files.max_upload_bytes(batches.limits),
    )
    # outermost: its span covers every layer
    app.add_middleware(ServerSpanMiddleware, trace_content=settings.trace_content)
    install_openapi(app)
    install_docs(app)
    return app
