"""`POST /v1/chat/completions`: validate, render the chat template, submit, answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from api import prepare
from api.auth import Principal
from api.deps import Gateway, build_off_loop_if_large, call_id, gateway, screened_principal
from api.errors import InvalidRequest, error_for_finish
from api.formatting import ChatFormat, generation_usage
from api.generation import Generation
from api.prepare import Call
from api.schemas import ChatCompletionRequest
from api.served import ServedModel
from api.streaming import DONE, PING, SSEResponse, collect_answer, pump, sse_data
from bus.messages import SamplingSpec

router = APIRouter(prefix="/v1", tags=["chat"])


def _sampling(body: ChatCompletionRequest, model: ServedModel, prompt_len: int) -> SamplingSpec:
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, model.max_model_len - prompt_len)
    return SamplingSpec(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=prepare.stop_list(body.stop),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )


def _validate(body: ChatCompletionRequest, gw: Gateway) -> None:
    prepare.check_common(body, gw.limits)
    if body.tools and body.tool_choice != "none":
        raise prepare.refuse("tools", "tool calling is not supported by this server")
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise prepare.refuse("response_format", f"response_format {fmt!r} is not supported")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest(
            "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    prepare.check_logprobs(body.top_logprobs, gw.limits, "top_logprobs")


def build(
    body: ChatCompletionRequest, headers: Any, principal: Principal, gw: Gateway, cid: str
) -> tuple[Call, ServedModel]:
    model = gw.models.get(body.model)
    _validate(body, gw)
    messages = [
        {"role": m.role, "content": prepare.message_text(m.content, f"messages[{i}].content")}
        for i, m in enumerate(body.messages)
    ]
    prompt_ids = prepare.render_chat(model, messages)
    sampling = _sampling(body, model, len(prompt_ids))
    prepare.check_prompt(model, prompt_ids, sampling.max_tokens, "messages")
    call = gw.call(
        headers,
        principal,
        model,
        [prompt_ids],
        n=body.n,
        sampling=sampling,
        service_tier=body.service_tier,
        call_id=cid,
    )
    return call, model


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    principal: Principal = Depends(screened_principal),
    gw: Gateway = Depends(gateway),
) -> Response | dict[str, Any]:
    cid = call_id(request)
    call, model = await build_off_loop_if_large(
        request, lambda: build(body, request.headers, principal, gw, cid)
    )
    generation = await gw.submit(request, principal, call.requests, call.deadline_ms)
    fmt = ChatFormat(call.call_id, model.name, generation.created, call.tier, model.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_stream(generation, fmt, call, body, include_usage, gw.sse_ping_s))
    results = await collect_answer(request, generation)
    if results is None:
        return Response(status_code=499)
    usage_obj = generation_usage(call.num_prompt_tokens, generation)
    return JSONResponse(fmt.completion(results, usage_obj, body.logprobs))


async def _stream(
    generation: Generation,
    fmt: ChatFormat,
    call: Call,
    body: ChatCompletionRequest,
    include_usage: bool,
    ping_s: float,
) -> AsyncIterator[str]:
    try:
        for index in range(len(generation.tracks)):
            yield sse_data(fmt.chunk(index, {"role": "assistant", "content": ""}))
        async for ev in pump(generation, ping_s):
            if ev is None:
                yield PING
                continue
            if ev.text or (body.logprobs and ev.logprobs):
                yield sse_data(
                    fmt.chunk(ev.index, {"content": ev.text}, None, ev.logprobs, body.logprobs)
                )
            if ev.finish_reason is None:
                continue
            error = error_for_finish(ev.finish_reason, ev.error)
            if error is not None:
                yield sse_data(error.body())
                yield DONE
                return
            yield sse_data(fmt.chunk(ev.index, {}, ev.finish_reason))
        if include_usage:
            yield sse_data(fmt.usage_chunk(generation_usage(call.num_prompt_tokens, generation)))
        yield DONE
    finally:
        generation.abandon()
