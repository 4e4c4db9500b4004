"""The gateway's SERVER span: one per HTTP request, ended when its response (a stream
included) has been sent, with the generation's token usage.

Pure ASGI and outermost, so the span covers every layer and a streamed body: the app's
call returns only once the stream ended. Its context is current while the routes run,
so the `send` spans of `api.service` (and through the record headers, the engine-side
spans of the tracing consumer) are its descendants; a client's own `traceparent`
becomes its parent. `GatewayService.submit` hands each generation to the span
(`note_generation`), which reads the usage when the response is done. With tracing off
(the no-op provider) nothing is recorded; a client's `traceparent` is still handed on in
the request records, so the tracing consumer's spans can join the client's trace.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.span_content import ContentCapture
from sluice.bus.messages import GenerateRequest
from sluice.tracing import spans as names

if TYPE_CHECKING:
    from sluice.api.generation import Generation

logger = logging.getLogger(__name__)

TRACED_PREFIX = "/v1/"  # the API; not health checks, /metrics scrapes or the dashboard
# the GenAI operation of each generating route, also handed to the engine-side spans as
# W3C baggage (the request records carry no route)
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
}


@dataclass(slots=True)
class _ServerCall:
    """What the routes of one HTTP request submitted, for its span's usage."""

    generations: list[tuple[list[GenerateRequest], Generation]] = field(default_factory=list)


_CALL: ContextVar[_ServerCall | None] = ContextVar("sluice_server_call", default=None)


def note_generation(requests: list[GenerateRequest], generation: Generation) -> None:
    """Count this generation's usage on the current request's server span (if any)."""
    call = _CALL.get()
    if call is not None:
        call.generations.append((requests, generation))


class ServerSpanMiddleware:
    def __init__(self, app: ASGIApp, trace_content: bool = False) -> None:
        self.app = app
        self.trace_content = trace_content  # prompts and outputs in the span (opt-in)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = propagate.extract(carrier)
        span = names.tracer().start_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        if not span.is_recording():
            # nothing exported here; a client's own trace still travels on to the workers
            if not trace.get_current_span(parent).get_span_context().is_valid:
                await self.app(scope, receive, send)
                return
            token = otel_context.attach(parent)
            try:
                await self.app(scope, receive, send)
            finally:
                otel_context.detach(token)
            return
        ctx = trace.set_span_in_context(span, parent)
        operation = OPERATIONS.get(path) if method == "POST" else None
        if operation is not None:
            ctx = baggage.set_baggage(names.GEN_AI_OPERATION, operation, ctx)
            span.set_attribute(names.GEN_AI_OPERATION, operation)
        call = _ServerCall()
        status: list[int] = []

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        content = ContentCapture() if self.trace_content else None
        inner_send: Send = send_status
        if content is not None:
            receive, inner_send = content.wrap(receive, send_status)
        token = otel_context.attach(ctx)
        call_token = _CALL.set(call)
        try:
            await self.app(scope, receive, inner_send)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            _CALL.reset(call_token)
            otel_context.detach(token)
            _finish(span, scope, status, call, content)


def _finish(
    span: trace.Span,
    scope: Scope,
    status: list[int],
    call: _ServerCall,
    content: ContentCapture | None,
) -> None:
    try:
        route = getattr(scope.get("route"), "path", None)
        if route:
            span.update_name(f"{scope['method']} {route}")
            span.set_attribute("http.route", route)
        request_id = scope.get("state", {}).get("request_id")
        if request_id:
            span.set_attribute(names.REQUEST_ID, request_id)
        if status:
            span.set_attribute("http.response.status_code", status[0])
            if status[0] >= 500:
                span.set_status(Status(StatusCode.ERROR))
        if call.generations:
            _usage(span, call)
        if content is not None:
            span.set_attributes(content.attributes())
    except Exception:  # telemetry never breaks the response
        logger.exception("server span not completed")
    finally:
        span.end()


def _usage(span: trace.Span, call: _ServerCall) -> None:
    """Tokens as the response's `usage` counts them: each distinct prompt once (n choices
    share theirs), every choice's completion tokens."""
    input_tokens = output_tokens = cached_tokens = 0
    attempts = 0
    for requests, generation in call.generations:
        prompts = {tuple(r.prompt_token_ids) for r in requests}
        input_tokens += sum(len(p) for p in prompts)
        output_tokens += generation.num_completion_tokens
        cached_tokens += generation.num_cached_tokens
        attempts = max([attempts, *(t.attempt + 1 for t in generation.tracks)])
    first = call.generations[0][0][0]
    span.set_attributes(names.usage_attributes(input_tokens, output_tokens, cached_tokens))
    span.set_attributes(
        {
            names.GEN_AI_PROVIDER: names.PROVIDER,
            names.GEN_AI_REQUEST_MODEL: first.model,
            names.TENANT_ID: first.tenant_id,
            names.LANE: first.lane.value,
            names.ATTEMPTS: attempts,
        }
    )
