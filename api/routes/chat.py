"""`POST /v1/chat/completions`: validate, render the chat template, submit, answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from sluice.api import output, prepare, structured, tools
from sluice.api.auth import Principal
from sluice.api.deps import Gateway, build_off_loop_if_large, call_id, gateway, screened_principal
from sluice.api.errors import InvalidRequest, error_for_finish
from sluice.api.formatting import ChatFormat, generation_usage, with_reasoning_tokens
from sluice.api.generation import Generation
from sluice.api.output import ChoiceReader, OutputPlan, reasoning_tokens
from sluice.api.prepare import Call
from sluice.api.reasoning import CLOSE
from sluice.api.schemas import ChatCompletionRequest
from sluice.api.served import ServedModel
from sluice.api.streaming import DONE, PING, SSEResponse, collect_answer, pump, sse_data
from sluice.api.tools import ToolPlan
from sluice.bus.messages import SamplingSpec, StructuredSpec

router = APIRouter(prefix="/v1", tags=["chat"])


def _sampling(
    body: ChatCompletionRequest,
    model: ServedModel,
    prompt_len: int,
    spec: StructuredSpec | None,
) -> SamplingSpec:
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
        prompt_logprobs=body.prompt_logprobs,
        structured=spec,
        **prepare.penalties(body, model),
    )


def _validate(body: ChatCompletionRequest, gw: Gateway) -> ToolPlan:
    prepare.check_common(body, gw.limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest(
            "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    prepare.check_logprobs(body.top_logprobs, gw.limits, "top_logprobs")
    return tools.chat_tools(body.tools, body.tool_choice, body.parallel_tool_calls)


def constraint(
    model: ServedModel, plan: ToolPlan, spec: StructuredSpec | None, param: str | None
) -> StructuredSpec | None:
    """The request's one constraint (its format, or a forced tool call), compiled once
    here so a bad one is a 400; with a reasoning parser it starts after the reasoning."""
    if plan.forced:
        if spec is not None:
            raise InvalidRequest(
                f"tool_choice {plan.choice!r} cannot be combined with {param}",
                param="tool_choice",
                code="invalid_value",
            )
        spec, param = tools.call_grammar(plan, model.tool_parser), "tool_choice"
    if spec is None:
        return None
    structured.check_compiles(model, spec, param or "response_format")
    if model.reasoning_parser == "think":
        spec = spec.model_copy(update={"after": CLOSE})
    return spec


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as `api.tools.render_messages` takes them."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        message: dict[str, Any] = {
            "role": m.role,
            "content": prepare.message_text(m.content, f"messages[{i}].content"),
        }
        if m.tool_calls:
            message["tool_calls"] = tools.call_history(m.tool_calls, f"messages[{i}].tool_calls")
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages


def output_plan(body: ChatCompletionRequest, model: ServedModel) -> OutputPlan:
    """How this request's output is read (for the route and for batch output lines)."""
    plan = tools.chat_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    return output.output_plan(model, plan)


def compiles(body: ChatCompletionRequest) -> bool:
    """Whether building this body compiles a constraint (it then builds off the loop)."""
    forced_call = body.tools and body.tool_choice not in (None, "none", "auto")
    return structured.constrained(body) or bool(forced_call)


def build(
    body: ChatCompletionRequest, headers: Any, principal: Principal, gw: Gateway, cid: str
) -> tuple[Call, ServedModel]:
    model = gw.models.get(body.model)
    plan = _validate(body, gw)
    spec, param = structured.request_spec(body)
    spec = constraint(model, plan, spec, param)
    template = getattr(model.tokenizer, "chat_template", None)
    messages, variables = tools.render_messages(
        chat_messages(body), plan, model.tool_parser, template
    )
    prompt_ids = prepare.render_chat(model, messages, variables)
    sampling = _sampling(body, model, len(prompt_ids), spec)
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
        request, lambda: build(body, request.headers, principal, gw, cid), compiles(body)
    )
    plan = output_plan(body, model)
    generation = await gw.submit(request, principal, call.requests, call.deadline_ms)
    fmt = ChatFormat(call.call_id, model.name, generation.created, call.tier, model.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_stream(generation, fmt, call, body, plan, include_usage, gw.sse_ping_s))
    results = await collect_answer(request, generation)
    if results is None:
        return Response(status_code=499)
    usage_obj = generation_usage(call.num_prompt_tokens, generation)
    return JSONResponse(
        fmt.completion(results, usage_obj, body.logprobs, plan, body.prompt_logprobs)
    )


async def _stream(
    generation: Generation,
    fmt: ChatFormat,
    call: Call,
    body: ChatCompletionRequest,
    plan: OutputPlan,
    include_usage: bool,
    ping_s: float,
) -> AsyncIterator[str]:
    readers = [ChoiceReader(plan) for _ in generation.tracks]
    try:
        for index in range(len(generation.tracks)):
            yield sse_data(fmt.chunk(index, {"role": "assistant", "content": ""}))
        async for ev in pump(generation, ping_s):
            if ev is None:
                yield PING
                continue
            if plan.plain:
                if ev.text or (body.logprobs and ev.logprobs):
                    yield sse_data(
                        fmt.chunk(ev.index, {"content": ev.text}, None, ev.logprobs, body.logprobs)
                    )
            else:
                reader = readers[ev.index]
                pieces = reader.feed(ev.text) if ev.text else []
                if ev.finish_reason is not None:
                    pieces += reader.finish()
                logprobs = ev.logprobs if body.logprobs else None
                for piece in pieces:
                    yield sse_data(
                        fmt.chunk(ev.index, fmt.delta(piece), None, logprobs, bool(logprobs))
                    )
                    logprobs = None
                if logprobs:  # tokens whose text is held back still show their logprobs
                    yield sse_data(fmt.chunk(ev.index, {"content": ""}, None, logprobs, True))
            if ev.finish_reason is None:
                continue
            error = error_for_finish(ev.finish_reason, ev.error)
            if error is not None:
                yield sse_data(error.body())
                yield DONE
                return
            finish: str = ev.finish_reason
            if readers[ev.index].calls and finish == "stop":
                finish = "tool_calls"
            yield sse_data(fmt.chunk(ev.index, {}, finish))
        if include_usage:
            usage_obj = generation_usage(call.num_prompt_tokens, generation)
            if plan.reasoning:
                count = reasoning_tokens(fmt.tokenizer, readers)
                usage_obj = with_reasoning_tokens(usage_obj, count)
            yield sse_data(fmt.usage_chunk(usage_obj))
        yield DONE
    finally:
        generation.abandon()
