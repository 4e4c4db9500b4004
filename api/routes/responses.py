"""`POST /v1/responses` (text and function tools) and its WebSocket mode on the same path.

The WebSocket mode is OpenAI's (the API reference's Responses WebSocket mode;
openai-python `resources/responses/responses.py::connect`): `response.create` events in, the
same events as the SSE stream out, so the official SDK's `client.responses.connect()`
works unmodified. Closing the socket cancels the responses still running. Each
`response.create` authenticates the handshake's key again (through the authenticator's
cache, as an HTTP request does), so a revoked key stops a socket opened before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from sluice.api import output, prepare, structured, tools
from sluice.api.auth import Principal, authenticate
from sluice.api.deps import Gateway, build_off_loop_if_large, call_id, gateway, screened_principal
from sluice.api.errors import APIError
from sluice.api.output import OutputPlan
from sluice.api.prepare import Call
from sluice.api.responses_format import ResponsesFormat, text_format_type
from sluice.api.routes import chat
from sluice.api.schemas import (
    ResponseFunctionCall,
    ResponseFunctionCallOutput,
    ResponseInputMessage,
    ResponsesRequest,
)
from sluice.api.served import ServedModel
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
    body: ResponsesRequest, headers: Any, principal: Principal, gw: Gateway, cid: str
) -> Call:
    model = gw.models.get(body.model)
    if body.previous_response_id:
        raise prepare.refuse("previous_response_id", "responses are not stored by this server")
    if body.background:
        raise prepare.refuse("background", "background responses are not supported")
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


@router.post("/responses", response_model=None)
async def create_response(
    body: ResponsesRequest,
    request: Request,
    principal: Principal = Depends(screened_principal),
    gw: Gateway = Depends(gateway),
) -> Response | dict[str, Any]:
    cid = call_id(request)
    call = await build_off_loop_if_large(
        request, lambda: build(body, request.headers, principal, gw, cid), compiles(body)
    )
    model = gw.models.get(body.model)
    generation = await gw.submit(request, principal, call.requests, call.deadline_ms)
    fmt = ResponsesFormat(
        call.call_id,
        body,
        call.tier,
        call.num_prompt_tokens,
        output_plan(body, model),
        model.tokenizer,
    )
    if body.stream:
        return SSEResponse(_sse(fmt.events(generation, gw.sse_ping_s), generation.abandon))
    results = await collect_answer(request, generation)
    if results is None:
        return Response(status_code=499)
    final = fmt.final(results[0], generation.num_completion_tokens, generation.num_cached_tokens)
    return JSONResponse(final)


async def _sse(events: AsyncIterator[dict[str, Any] | None], abandon: Any) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield PING if event is None else sse_event(event)
    finally:
        abandon()


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
        model = gw.models.get(body.model)
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
