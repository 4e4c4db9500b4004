"""`/v1/responses`: create (text and function tools), stored responses, the WebSocket mode.

Stored and background responses (`store`, default true; `background`;
`previous_response_id`; `GET`, `cancel`, `DELETE` and `input_items` by id) go through the
app's `ResponseKeeper` (`api.stored_responses`), present when the gateway has a database.
A response of another tenant reads as missing (404), never as forbidden.

The WebSocket mode is OpenAI's (the API reference's Responses WebSocket mode;
openai-python `resources/responses/responses.py::connect`): `response.create` events in, the
same events as the SSE stream out, so the official SDK's `client.responses.connect()`
works unmodified. Closing the socket cancels the responses still running. Each
`response.create` authenticates the handshake's key again (through the authenticator's
cache, as an HTTP request does), so a revoked key stops a socket opened before it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError
from starlette.requests import HTTPConnection

from sluice.api import output, prepare, structured, tools
from sluice.api.auth import Principal, authenticate, require_principal
from sluice.api.deps import Gateway, build_off_loop_if_large, call_id, gateway, screened_principal
from sluice.api.errors import APIError, InvalidRequest, ServiceUnavailable
from sluice.api.output import OutputPlan
from sluice.api.prepare import Call
from sluice.api.responses_format import ResponsesFormat, as_input, input_items, text_format_type
from sluice.api.resume import not_resumable
from sluice.api.routes import chat
from sluice.api.run import resumable_stream, resumed_stream, stream_key
from sluice.api.schemas import (
    ResponseFunctionCall,
    ResponseFunctionCallOutput,
    ResponseInputItem,
    ResponseInputMessage,
    ResponsesRequest,
)
from sluice.api.served import ServedModel
from sluice.api.stored_responses import ResponseKeeper, not_found
from sluice.api.streaming import (
    PING,
    SSEResponse,
    WsSession,
    collect_answer,
    refuse_handshake,
    sse_event,
    ws_error,
    ws_refusal,
)
from sluice.bus.messages import SamplingSpec

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["responses"])


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as chat messages (`api.tools.render_messages`'s shape): a function call
    joins the assistant turn before it, its output is a `tool` message."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for i, item in enumerate(body.input):
        if isinstance(item, ResponseFunctionCall):
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if isinstance(item, ResponseFunctionCallOutput):
            output = item.output
            if not isinstance(output, str):
                output = prepare.message_text([p.model_dump() for p in output], f"input[{i}]")
            messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
            continue
        if not isinstance(item, ResponseInputMessage):
            continue  # reasoning items of an earlier output are not rendered again
        content = item.content
        if not isinstance(content, str):
            content = prepare.message_text([p.model_dump() for p in content], f"input[{i}]")
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": content})
    return messages


def _tools(body: ResponsesRequest) -> tools.ToolPlan:
    return tools.responses_tools(body.tools, body.tool_choice, body.parallel_tool_calls)


def output_plan(body: ResponsesRequest, model: ServedModel) -> OutputPlan:
    return output.output_plan(model, _tools(body))


def compiles(body: ResponsesRequest) -> bool:
    return text_format_type(body.text) != "text" or (
        bool(body.tools) and body.tool_choice not in (None, "none", "auto")
    )


def build(
    body: ResponsesRequest,
    headers: Any,
    principal: Principal,
    gw: Gateway,
    cid: str,
    *,
    stored: bool = False,
) -> Call:
    """The call of one request; `stored`: the HTTP route, which keeps responses (the
    WebSocket mode and batch lines do not)."""
    model = gw.models.get(body.model, principal)
    if not stored and body.previous_response_id:
        raise prepare.refuse("previous_response_id", "only HTTP requests continue a response")
    if not stored and body.background:
        raise prepare.refuse("background", "only HTTP requests run in the background")
    text_format_type(body.text)  # checks its shape
    plan = _tools(body)
    spec = structured.response_format_spec((body.text or {}).get("format"), "text.format")
    param = "text.format.schema" if spec is not None and spec.kind == "json_schema" else None
    spec = chat.constraint(model, plan, spec, param or "text.format")
    prepare.check_logprobs(body.top_logprobs, gw.limits, "top_logprobs")
    template = getattr(model.tokenizer, "chat_template", None)
    messages, variables = tools.render_messages(_messages(body), plan, model.tool_parser, template)
    prompt_ids = prepare.render_chat(model, messages, variables)
    max_tokens = body.max_output_tokens or max(1, model.max_model_len - len(prompt_ids))
    prepare.check_prompt(model, prompt_ids, max_tokens, "input")
    sampling = SamplingSpec(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=max_tokens,
        structured=spec,
    )
    return gw.call(
        headers,
        principal,
        model,
        [prompt_ids],
        n=1,
        sampling=sampling,
        service_tier=body.service_tier,
        call_id=cid,
    )


_ITEMS = TypeAdapter(list[ResponseInputItem])
# Ids Sluice hands out (`resp_<hex>`) fit this; anything else names no response and is
# never sent to the database (PostgreSQL refuses NUL and lone surrogates with an error).
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def response_keeper(conn: HTTPConnection) -> ResponseKeeper | None:
    keeper: ResponseKeeper | None = getattr(conn.app.state, "responses", None)
    return keeper


def _keeper_for(conn: HTTPConnection, param: str) -> ResponseKeeper:
    keeper = response_keeper(conn)
    if keeper is None:
        raise ServiceUnavailable(
            f"{param} needs stored responses, which need the database: set"
            " SLUICE_DATABASE_URL for `sluice gateway`, or run `sluice serve`",
            code="responses_unavailable",
        )
    return keeper


async def _continued(
    body: ResponsesRequest, keeper: ResponseKeeper, tenant_id: str, own: list[dict[str, Any]]
) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    """`previous_response_id`: the body whose input is the previous response's input
    items and output, then its own input (instructions are not carried over, as
    OpenAI's), and the items that input is stored as."""
    assert body.previous_response_id is not None
    if _ID.fullmatch(body.previous_response_id) is None:
        raise not_found(body.previous_response_id)
    items = [*await keeper.previous_items(body.previous_response_id, tenant_id), *own]
    try:
        combined = _ITEMS.validate_python([as_input(item) for item in items])
    except ValidationError as exc:
        raise InvalidRequest(
            "the previous response's items cannot be continued", param="previous_response_id"
        ) from exc
    return body.model_copy(update={"input": combined}), items


@router.post("/responses", response_model=None)
async def create_response(
    body: ResponsesRequest,
    request: Request,
    principal: Principal = Depends(screened_principal),
    gw: Gateway = Depends(gateway),
) -> Response | dict[str, Any]:
    window_s = gw.service.streams.window_s
    kept = _STORED_EVENT_ID.fullmatch(request.headers.get("last-event-id", "").strip())
    if kept is not None and body.stream:  # a stored response's stream, resumed
        keeper = response_keeper(request)
        if keeper is None:
            raise not_resumable(kept.group(0))
        key = stream_key(request, body)
        after = int(kept.group(2))
        events = keeper.resume_streamed(kept.group(1), after, principal.tenant_id, key, window_s)
        return SSEResponse(_sse_with_ids(kept.group(1), events))
    resumed = await resumed_stream(request, principal, body, gw)  # `Last-Event-ID`
    if resumed is not None:
        return resumed
    cid = call_id(request)
    keeper = response_keeper(request)
    if body.background and body.store is False:
        raise InvalidRequest("background responses need store=true", param="store")
    if body.background:
        keeper = _keeper_for(request, "background")
    items = input_items(body, cid)
    if body.previous_response_id:
        keeper = _keeper_for(request, "previous_response_id")
        body, items = await _continued(body, keeper, principal.tenant_id, items)
    stored = keeper is not None and body.store is not False
    call = await build_off_loop_if_large(
        request,
        lambda: build(body, request.headers, principal, gw, cid, stored=True),
        compiles(body),
    )
    model = gw.models.get(body.model, principal)
    generation = await gw.submit(request, principal, call.requests, call.deadline_ms)
    fmt = ResponsesFormat(
        call.call_id,
        body,
        call.tier,
        call.num_prompt_tokens,
        output_plan(body, model),
        model.tokenizer,
        stored=stored,
    )
    if body.background:
        assert keeper is not None
        queued = await keeper.run_background(
            fmt, generation, principal.tenant_id, items, gw.sse_ping_s
        )
        if body.stream:
            return SSEResponse(_sse(await keeper.follow(fmt.id, principal.tenant_id, -1)))
        return JSONResponse(queued)
    keep = keeper.keep if stored and keeper is not None else None
    if body.stream and keep is None:
        return resumable_stream(
            request,
            principal,
            body,
            call.call_id,
            generation,
            gw,
            lambda: _sse(copy.copy(fmt).events(generation, gw.sse_ping_s)),
        )
    if body.stream:  # stored as it runs, resumable (`ResponseKeeper.run_streamed`)
        assert keeper is not None
        key = stream_key(request, body)
        events = await keeper.run_streamed(
            fmt, generation, principal.tenant_id, items, gw.sse_ping_s, key, window_s
        )
        return SSEResponse(_sse_with_ids(fmt.id, events))
    results = await collect_answer(request, generation)
    if results is None:
        return Response(status_code=499)
    final = fmt.final(results[0], generation.num_completion_tokens, generation.num_cached_tokens)
    if keep is not None:
        await keep(final, principal.tenant_id, items)
    return JSONResponse(final)


async def _sse(
    events: AsyncIterator[dict[str, Any] | None], abandon: Any = None
) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield PING if event is None else sse_event(event)
    finally:
        if abandon is not None:
            abandon()


# A stored response's event id (`<response id>:<sequence_number>`); a stream's of
# `api.resume` has three parts, so the two never read as each other.
_STORED_EVENT_ID = re.compile(r"(resp_[A-Za-z0-9_-]{1,59}):(\d{1,9})")


async def _sse_with_ids(
    response_id: str, events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[str]:
    """A stored response's events, each with its SSE `id:` (`_STORED_EVENT_ID`)."""
    async for event in events:
        yield f"id: {response_id}:{event['sequence_number']}\n{sse_event(event)}"


# -- stored responses --------------------------------------------------------------------
def _stored_keeper(conn: HTTPConnection, response_id: str) -> ResponseKeeper:
    """The keeper, for an id that may name a stored response; 404 otherwise."""
    keeper = response_keeper(conn)
    if keeper is None or _ID.fullmatch(response_id) is None:
        raise not_found(response_id)
    return keeper


@router.get("/responses/{response_id}", response_model=None)
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = Query(default=None, ge=-1),
    principal: Principal = Depends(require_principal),
) -> Response | dict[str, Any]:
    keeper = _stored_keeper(request, response_id)
    if stream:
        after = -1 if starting_after is None else starting_after
        return SSEResponse(_sse(await keeper.follow(response_id, principal.tenant_id, after)))
    return (await keeper.get(response_id, principal.tenant_id)).body


@router.post("/responses/{response_id}/cancel")
async def cancel_response(
    response_id: str, request: Request, principal: Principal = Depends(require_principal)
) -> dict[str, Any]:
    keeper = _stored_keeper(request, response_id)
    return await keeper.cancel(response_id, principal.tenant_id)


@router.delete("/responses/{response_id}")
async def delete_response(
    response_id: str, request: Request, principal: Principal = Depends(require_principal)
) -> dict[str, Any]:
    keeper = _stored_keeper(request, response_id)
    await keeper.delete(response_id, principal.tenant_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    principal: Principal = Depends(require_principal),
) -> dict[str, Any]:
    keeper = _stored_keeper(request, response_id)
    items = (await keeper.get(response_id, principal.tenant_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.websocket("/responses")
async def responses_websocket(websocket: WebSocket) -> None:
    gw = gateway(websocket)
    refusal = ws_refusal(websocket)
    if refusal is not None:
        await refuse_handshake(websocket, refusal)
        return
    try:
        await authenticate(websocket)
    except APIError as exc:
        await refuse_handshake(websocket, exc.message)
        return
    await websocket.accept()

    async def source(event: dict[str, Any], cid: str) -> AsyncIterator[dict[str, Any]]:
        # AuthenticationFailed (revoked) goes up: WsSession answers it and closes
        principal = await authenticate(websocket)
        payload = {k: v for k, v in event.items() if k not in {"type", "stream"}}
        try:
            gw.rate_gate.check(principal)  # as `screened_principal` does for HTTP
            gw.check_input_size(payload)
            body = ResponsesRequest.model_validate(payload)
            call = await asyncio.to_thread(build, body, websocket.headers, principal, gw, cid)
            generation = await gw.submit(websocket, principal, call.requests, call.deadline_ms)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            message = f"{param}: {first['msg']}" if param else str(first["msg"])
            yield ws_error(400, message, "invalid_value", param)
            return
        except APIError as exc:
            yield ws_error(exc.status_code, exc.message, exc.code, exc.param)
            return
        model = gw.models.get(body.model, principal)
        fmt = ResponsesFormat(
            call.call_id,
            body,
            call.tier,
            call.num_prompt_tokens,
            output_plan(body, model),
            model.tokenizer,
        )
        try:
            async for out in fmt.events(generation, gw.sse_ping_s):
                if out is not None:
                    yield out
        finally:
            generation.abandon("websocket closed")

    await WsSession(websocket, source, gw.ws_max_pending).run()
