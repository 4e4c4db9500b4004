"""`POST /v1/chat/completions`: validate, render the chat template, submit, answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from sluice.api import output, prepare, structured, tools
from sluice.api.auth import Principal
from sluice.api.deps import Gateway
from sluice.api.errors import InvalidRequest
from sluice.api.formatting import ChatFormat, with_reasoning_tokens
from sluice.api.generation import ChoiceResult, Generation, StreamEvent
from sluice.api.output import ChoiceReader, OutputPlan, reasoning_tokens
from sluice.api.prepare import Call
from sluice.api.reasoning import CLOSE
from sluice.api.run import CallAnswer, Caller, caller, run_call
from sluice.api.schemas import ChatCompletionRequest
from sluice.api.served import ServedModel
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
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        structured=spec,
        **prepare.sampling_fields(body, model),
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
    model = gw.models.get(body.model, principal)
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
    body: ChatCompletionRequest, who: Caller = Depends(caller)
) -> Response | dict[str, Any]:
    return await run_call(who, body, build, compiles, _ChatAnswer)


class _ChatAnswer(CallAnswer):
    """Chat chunks: a role chunk per choice first, then content, tool calls and
    reasoning as the output plan reads them; a stop with tool calls is 'tool_calls'."""

    def __init__(self, body: ChatCompletionRequest, call: Call, model: ServedModel) -> None:
        super().__init__(body, call, model)
        self.body = body
        self.plan = output_plan(body, model)
        self.readers: list[ChoiceReader] = []

    def begin(self, generation: Generation) -> None:
        call, model = self.call, self.model
        self.fmt = ChatFormat(
            call.call_id, model.name, generation.created, call.tier, model.tokenizer
        )
        self.readers = [ChoiceReader(self.plan) for _ in generation.tracks]

    def opening(self) -> Iterator[dict[str, Any]]:
        for index in range(len(self.readers)):
            yield self.fmt.chunk(index, {"role": "assistant", "content": ""})

    def before_finish(self, ev: StreamEvent) -> Iterator[dict[str, Any]]:
        fmt, want = self.fmt, self.body.logprobs
        if self.plan.plain:
            if ev.text or (want and ev.logprobs):
                yield fmt.chunk(ev.index, {"content": ev.text}, None, ev.logprobs, want)
            return
        reader = self.readers[ev.index]
        pieces = reader.feed(ev.text) if ev.text else []
        if ev.finish_reason is not None:
            pieces += reader.finish()
        logprobs = ev.logprobs if want else None
        for piece in pieces:
            yield fmt.chunk(ev.index, fmt.delta(piece), None, logprobs, bool(logprobs))
            logprobs = None
        if logprobs:  # tokens whose text is held back still show their logprobs
            yield fmt.chunk(ev.index, {"content": ""}, None, logprobs, True)

    def after_finish(self, ev: StreamEvent) -> Iterator[dict[str, Any]]:
        if ev.finish_reason is None:
            return
        finish: str = ev.finish_reason
        if self.readers[ev.index].calls and finish == "stop":
            finish = "tool_calls"
        yield self.fmt.chunk(ev.index, {}, finish)

    def usage_chunk(self, generation: Generation) -> dict[str, Any]:
        usage_obj = self.usage(generation)
        if self.plan.reasoning:
            count = reasoning_tokens(self.fmt.tokenizer, self.readers)
            usage_obj = with_reasoning_tokens(usage_obj, count)
        return self.fmt.usage_chunk(usage_obj)

    def whole(self, results: list[ChoiceResult], usage_obj: dict[str, Any]) -> dict[str, Any]:
        body = self.body
        return self.fmt.completion(
            results, usage_obj, body.logprobs, self.plan, body.prompt_logprobs
        )
