"""What routes need from the app, as FastAPI dependencies."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import HTTPConnection, Request

from sluice.api.auth import Principal, require_principal
from sluice.api.errors import EngineNotReady, EngineUnavailable, InvalidRequest, RateLimited
from sluice.api.generation import Generation
from sluice.api.prepare import Call, RequestLimits, build_call, deadline_ms_for
from sluice.api.served import ModelCatalog, ServedModel
from sluice.api.service import GatewayService
from sluice.api.tenancy import GatewayAdmission
from sluice.bus.messages import GenerateRequest, SamplingSpec
from sluice.tracing.metrics import count_admission


class RequestRateGate:
    """Each tenant's requests per minute, counted before a request is validated or built.

    Admission (`api.tenancy`) counts rpm only for a request that got as far as being
    admitted, after its body was validated, templated and tokenized; a flood of
    expensive invalid requests would cost that work every time. This gate counts every
    request of a tenant with an rpm limit first, whatever its answer, as GCRA with the
    plan's burst (the quota stores' shape), and answers 429 past it. It is this
    gateway's own count: across replicas it is looser than the plan, never stricter.
    """

    WINDOW_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tat: dict[str, float] = {}  # tenant_id -> theoretical arrival time

    def check(self, principal: Principal) -> None:
        """Count one request of `principal`; raise RateLimited past its rpm."""
        limits = principal.limits
        if limits is None or limits.rpm is None:
            return
        now = self._clock()
        if len(self._tat) > 4096:  # a tenant whose count ran out holds nothing: forget it
            self._tat = {t: v for t, v in self._tat.items() if v > now}
        tat = max(self._tat.get(principal.tenant_id, now), now)
        new_tat = tat + (self.WINDOW_S / limits.rpm if limits.rpm else math.inf)
        wait_s = new_tat - self.WINDOW_S - now
        if wait_s > 0:
            count_admission("rejected", "requests")  # as admission labels an rpm refusal
            retry_s = str(max(1, math.ceil(min(wait_s, self.WINDOW_S))))
            raise RateLimited(
                f"Rate limit reached on requests per minute. Retry after {retry_s}s.",
                {"retry-after": retry_s, "x-ratelimit-limit-requests": str(limits.rpm)},
            )
        self._tat[principal.tenant_id] = new_tat


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
    rate_gate: RequestRateGate = field(default_factory=RequestRateGate)

    def check_input_size(self, raw: Any) -> None:
        """400 for a body with more than `max_messages` messages (chat `messages`,
        responses `input`) or a message of more than `max_content_parts` parts: checked
        on the parsed JSON, before validation and the chat template spend CPU on it."""
        if not isinstance(raw, dict):
            return
        for param in ("messages", "input"):
            items = raw.get(param)
            if not isinstance(items, list):
                continue
            _check_length(items, param, self.max_messages)
            for i, item in enumerate(items):
                content = item.get("content") if isinstance(item, dict) else None
                if isinstance(content, list):
                    _check_length(content, f"{param}[{i}].content", self.max_content_parts)

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
            reply_beats=self.service.heartbeat_s > 0,
        )

    async def submit(
        self,
        conn: HTTPConnection,
        principal: Principal,
        requests: Sequence[GenerateRequest],
        deadline_ms: int | None,
    ) -> Generation:
        """Admit (TTFT target, tenant keys) and publish one call's sub-requests."""
        require_engine_ready(conn)
        if self.service.slo is not None:  # before the quota: a refused call takes nothing
            self.service.slo.check(requests)
        if self.admission is None:
            return await self.service.submit(requests, deadline_ms)
        return await self.admission.submit(conn, principal, requests, deadline_ms)


def require_engine_ready(conn: HTTPConnection) -> None:
    """Embedded mode: 503 at once while this process's engine worker is not ready (the
    probe `/readyz` uses), rather than a request waiting out the model's load or an
    engine that does not come up; the message names the cause once the probe has one."""
    probe = getattr(conn.app.state, "worker_probe", None)
    if probe is not None and not probe.ready():
        cause = probe.unavailable()
        raise EngineUnavailable(cause) if cause else EngineNotReady()


def _check_length(items: list[Any], param: str, most: int) -> None:
    if len(items) > most:
        raise InvalidRequest(
            f"Invalid '{param}': array too long. Expected an array with maximum length"
            f" {most}, but got an array with length {len(items)} instead.",
            param=param,
            code="array_above_max_length",
        )


async def screened_principal(request: Request) -> Principal:
    """The caller of a generation route, screened before its body is validated and built:
    counted against its tenant's rpm (`RequestRateGate`) and its message counts bounded.
    FastAPI has parsed the JSON already (`request.json()` returns it); the pydantic
    validation, template and tokenizing that follow are what a flood would cost."""
    principal = await require_principal(request)
    gw = gateway(request)
    gw.rate_gate.check(principal)
    try:
        raw = await request.json()
    except ValueError:
        return principal  # not JSON: the route's validation answers it
    gw.check_input_size(raw)
    return principal


def gateway(conn: HTTPConnection) -> Gateway:
    state: Gateway = conn.app.state.gateway
    return state


def call_id(conn: HTTPConnection) -> str:
    """The hex part of this request's x-request-id (`req_<hex>`)."""
    request_id: str = conn.scope["state"]["request_id"]
    return request_id.removeprefix("req_")


T = TypeVar("T")
# Below this a body tokenizes in microseconds on the loop; a hop to a worker thread costs
# a scheduling wait that shows in the TTFT p99. Above it, or with no length
# (chunked), tokenizing could block every other request: it runs on a thread.
INLINE_BUILD_MAX_BYTES = 16 * 1024


async def build_off_loop_if_large(
    conn: HTTPConnection, build: Callable[[], T], compiles: bool = False
) -> T:
    """Run a route's `build` (validation, chat template, tokenizing) for this request;
    `compiles`: it compiles an output constraint (milliseconds, and once per model the
    tokenizer's view for llguidance), so it runs on a thread whatever the body's size."""
    length = conn.headers.get("content-length", "")
    if not compiles and length.isdigit() and int(length) <= INLINE_BUILD_MAX_BYTES:
        return build()
    return await asyncio.to_thread(build)
