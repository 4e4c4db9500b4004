"""`POST /v1/completions` (legacy): prompt as text or token ids, or a list of either."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from sluice.api import prepare, structured
from sluice.api.auth import Principal
from sluice.api.deps import Gateway, build_off_loop_if_large, call_id, gateway, screened_principal
from sluice.api.errors import error_for_finish
from sluice.api.formatting import CompletionFormat, EchoedPrompt, generation_usage
from sluice.api.generation import Generation
from sluice.api.prepare import Call
from sluice.api.schemas import CompletionRequest
from sluice.api.served import ServedModel
from sluice.api.streaming import DONE, PING, SSEResponse, collect_answer, pump, sse_data
from sluice.bus.messages import SamplingSpec

router = APIRouter(prefix="/v1", tags=["completions"])


def build(
    body: CompletionRequest, headers: Any, principal: Principal, gw: Gateway, cid: str
) -> tuple[Call, ServedModel]:
    model = gw.models.get(body.model)
    prepare.check_common(body, gw.limits)
    if body.suffix:
        raise prepare.refuse("suffix", "suffix is not supported by this server")
    if body.best_of is not None and body.best_of != body.n:
        raise prepare.refuse("best_of", "best_of other than n is not supported")
    prepare.check_logprobs(body.logprobs, gw.limits, "logprobs")
    spec, param = structured.request_spec(body)
    if spec is not None:
        structured.check_compiles(model, spec, param or "structured_outputs")
    prompts = prepare.encode_prompts(model, body.prompt)
    max_tokens = body.max_tokens or 16
    for prompt_ids in prompts:
        prepare.check_prompt(model, prompt_ids, max_tokens, "prompt")
    sampling = SamplingSpec(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=prepare.stop_list(body.stop),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs(body),
        structured=spec,
        **prepare.penalties(body, model),
    )
    call = gw.call(
        headers,
        principal,
        model,
        prompts,
        n=body.n,
        sampling=sampling,
        service_tier=body.service_tier,
        call_id=cid,
    )
    return call, model


def prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many alternatives the engine reports at each prompt token: echo with logprobs
    shows the prompt's logprobs, vLLM's `prompt_logprobs` asks for them (the larger wins,
    each answer shows its own count)."""
    counts = [body.prompt_logprobs]
    if body.echo:
        counts.append(body.logprobs)
    given = [c for c in counts if c is not None]
    return max(given) if given else None


def echo_prompts(body: CompletionRequest, call: Call) -> list[list[int]] | None:
    """Each choice's prompt token ids when its echo shows their logprobs."""
    if not body.echo or body.logprobs is None:
        return None
    return [r.prompt_token_ids for r in call.requests]


def echo_texts(body: CompletionRequest, model: ServedModel) -> list[str] | None:
    """With `echo`, each choice's prompt text (choices run prompt by prompt, n each); token
    id prompts decoded as vLLM does, special tokens kept."""
    if not body.echo:
        return None
    prompt = body.prompt
    prompts: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    texts = [
        p if isinstance(p, str) else model.tokenizer.decode(p, skip_special_tokens=False)
        for p in prompts
    ]
    return [text for text in texts for _ in range(body.n)]


def compiles(body: CompletionRequest) -> bool:
    return structured.constrained(body)


@router.post("/completions", response_model=None)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    principal: Principal = Depends(screened_principal),
    gw: Gateway = Depends(gateway),
) -> Response | dict[str, Any]:
    cid = call_id(request)
    call, model = await build_off_loop_if_large(
        request, lambda: build(body, request.headers, principal, gw, cid), compiles(body)
    )
    echo = echo_texts(body, model)
    generation = await gw.submit(request, principal, call.requests, call.deadline_ms)
    fmt = CompletionFormat(call.call_id, model.name, generation.created, call.tier, model.tokenizer)
    want_logprobs = body.logprobs is not None
    prompts = echo_prompts(body, call)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(
            _stream(
                generation,
                fmt,
                call,
                _Wants(want_logprobs, body.return_token_ids, include_usage, body.logprobs or 0),
                gw.sse_ping_s,
                echo,
                prompts,
            )
        )
    results = await collect_answer(request, generation)
    if results is None:
        return Response(status_code=499)
    usage_obj = generation_usage(call.num_prompt_tokens, generation)
    return JSONResponse(
        fmt.completion(
            results,
            usage_obj,
            want_logprobs,
            body.return_token_ids,
            echo,
            prompts,
            body.logprobs or 0,
            body.prompt_logprobs,
        )
    )


@dataclass(frozen=True, slots=True)
class _Wants:
    """What a stream's chunks carry beyond the text."""

    logprobs: bool
    token_ids: bool
    usage: bool
    top: int = 0  # the request's `logprobs`: alternatives per token


async def _stream(
    generation: Generation,
    fmt: CompletionFormat,
    call: Call,
    wants: _Wants,
    ping_s: float,
    echo: list[str] | None = None,
    prompts: list[list[int]] | None = None,
) -> AsyncIterator[str]:
    """`echo`: the prompt comes first; with `prompts` (echo with logprobs) a choice's
    prompt chunk waits for its first event, which brings the prompt's logprobs."""
    text_offsets = [0] * len(generation.tracks)
    unechoed = set(range(len(echo))) if echo and prompts else set()
    try:
        for index, text in enumerate(echo or []):
            if index not in unechoed:
                yield sse_data(fmt.chunk(index, text, None, None, 0, False))
                text_offsets[index] = len(text)
        async for ev in pump(generation, ping_s):
            if ev is None:
                yield PING
                continue
            if ev.index in unechoed:
                assert echo is not None and prompts is not None
                unechoed.discard(ev.index)
                prompt = None
                if ev.prompt_logprobs is not None:
                    prompt = EchoedPrompt(prompts[ev.index], ev.prompt_logprobs, wants.top)
                text = echo[ev.index]
                yield sse_data(fmt.chunk(ev.index, text, None, None, 0, True, None, prompt))
                text_offsets[ev.index] = len(text)
            if ev.finish_reason is not None:
                error = error_for_finish(ev.finish_reason, ev.error)
                if error is not None:
                    yield sse_data(error.body())
                    yield DONE
                    return
            # with token ids, a token whose text is still held back gets a chunk too
            if (
                ev.text
                or ev.finish_reason is not None
                or (wants.logprobs and ev.logprobs)
                or (wants.token_ids and ev.token_ids)
            ):
                chunk = fmt.chunk(
                    ev.index,
                    ev.text,
                    ev.finish_reason,
                    ev.logprobs,
                    text_offsets[ev.index],
                    wants.logprobs,
                    ev.token_ids if wants.token_ids else None,
                )
                text_offsets[ev.index] += len(ev.text)
                yield sse_data(chunk)
        if wants.usage:
            yield sse_data(fmt.usage_chunk(generation_usage(call.num_prompt_tokens, generation)))
        yield DONE
    finally:
        generation.abandon()
