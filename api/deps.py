"""What routes need from the app, as FastAPI dependencies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import HTTPConnection

from api.auth import Principal
from api.errors import EngineNotReady
from api.generation import Generation
from api.prepare import Call, RequestLimits, build_call, deadline_ms_for
from api.served import ModelCatalog, ServedModel
from api.service import GatewayService
from api.tenancy import GatewayAdmission
from bus.messages import GenerateRequest, SamplingSpec


@dataclass(frozen=True, slots=True)
class Gateway:
    """The app's collaborators, stored on `app.state.gateway` by `create_app`.

    `admission` is None in static-key mode (no tenant store): nothing is admitted.
    `ws_max_pending`, `max_messages` and `max_content_parts` are the settings of those
    names (`sluice.settings.GatewaySettings`).
    """

    service: GatewayService
    models: ModelCatalog
    limits: RequestLimits
    sse_ping_s: float
    admission: GatewayAdmission | None = None
    admin_key: str | None = None
    # what one hostile request or connection may make the gateway hold or compute
    ws_max_pending: int = 64
    max_messages: int = 4096
    max_content_parts: int = 512

    def call(
        self,
        headers: Mapping[str, str],
        principal: Principal,
        model: ServedModel,
        prompts: Sequence[list[int]],
        *,
        n: int,
        sampling: SamplingSpec,
        service_tier: str | None,
        call_id: str,
    ) -> Call:
        """A call's sub-requests, with this gateway's reply target, limits and deadline."""
        return build_call(
            principal=principal,
            model=model,
            prompts=prompts,
            n=n,
            sampling=sampling,
            service_tier=service_tier,
            deadline_ms=deadline_ms_for(headers, self.limits, int(time.time() * 1000)),
            reply_to=self.service.gateway_id,
            limits=self.limits,
            call_id=call_id,
        )

    async def submit(
        self,
        conn: HTTPConnection,
        principal: Principal,
        requests: Sequence[GenerateRequest],
        deadline_ms: int | None,
    ) -> Generation:
        """Admit (tenant keys) and publish one call's sub-requests."""
        require_engine_ready(conn)
        if self.admission is None:
            return await self.service.submit(requests, deadline_ms)
        return await self.admission.submit(conn, principal, requests, deadline_ms)


def require_engine_ready(conn: HTTPConnection) -> None:
    """Embedded mode: 503 at once while this process's engine worker is not ready (the
    probe `/readyz` uses), rather than a request waiting out the model's load."""
    probe = getattr(conn.app.state, "worker_probe", None)
    if probe is not None and not probe.ready():
        raise EngineNotReady()


def gateway(conn: HTTPConnection) -> Gateway:
    state: Gateway = conn.app.state.gateway
    return state


def call_id(conn: HTTPConnection) -> str:
    """The hex part of this request's x-request-id (`req_<hex>`)."""
    request_id: str = conn.scope["state"]["request_id"]
    return request_id.removeprefix("req_")


T = TypeVar("T")
# Below this a body tokenizes in microseconds on the loop; a hop to a worker thread costs
# a scheduling wait (seen at the TTFT p99 on 2 cores). Above it, or with no length
# (chunked), tokenizing could block every other request: it runs on a thread.
INLINE_BUILD_MAX_BYTES = 16 * 1024


async def build_off_loop_if_large(conn: HTTPConnection, build: Callable[[], T]) -> T:
    """Run a route's `build` (validation, chat template, tokenizing) for this request."""
    length = conn.headers.get("content-length", "")
    if length.isdigit() and int(length) <= INLINE_BUILD_MAX_BYTES:
        return build()
    return await asyncio.to_thread(build)
