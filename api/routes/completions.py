"""`POST /v1/completions` (legacy): prompt as text or token ids, or a list of either."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from sluice.api import prepare, structured
from sluice.api.auth import Principal
from sluice.api.deps import Gateway
from sluice.api.formatting import CompletionFormat, EchoedPrompt
from sluice.api.generation import ChoiceResult, Generation, StreamEvent
from sluice.api.prepare import Call
from sluice.api.run import CallAnswer, Caller, caller, run_call
from sluice.api.schemas import CompletionRequest
from sluice.api.served import ServedModel
from sluice.bus.messages import SamplingSpec

router = APIRouter(prefix="/v1", tags=["completions"])


def build(
    body: CompletionRequest, headers: Any, principal: Principal, gw: Gateway, cid: str
) -> tuple[Call, ServedModel]:
    model = gw.models.get(body.model, principal)
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
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs(body),
        structured=spec,
        **prepare.sampling_fields(body, model),
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
    body: CompletionRequest, who: Caller = Depends(caller)
) -> Response | dict[str, Any]:
    return await run_call(who, body, build, compiles, _CompletionAnswer)


class _CompletionAnswer(CallAnswer):
    """Completion chunks: with `echo` the prompt comes first; with `prompts` (echo with
    logprobs) a choice's prompt chunk waits for its first event, which brings the
    prompt's logprobs."""

    def __init__(self, body: CompletionRequest, call: Call, model: ServedModel) -> None:
        super().__init__(body, call, model)
        self.body = body
        self.echo = echo_texts(body, model)
        self.prompts = echo_prompts(body, call)
        self.want_logprobs = body.logprobs is not None
        self.top = body.logprobs or 0  # alternatives per token
        self.text_offsets: list[int] = []
        self.unechoed: set[int] = set()

    def begin(self, generation: Generation) -> None:
        call, model = self.call, self.model
        self.fmt = CompletionFormat(
            call.call_id, model.name, generation.created, call.tier, model.tokenizer
        )
        self.text_offsets = [0] * len(generation.tracks)
        if self.echo and self.prompts:
            self.unechoed = set(range(len(self.echo)))

    def opening(self) -> Iterator[dict[str, Any]]:
        for index, text in enumerate(self.echo or []):
            if index not in self.unechoed:
                yield self.fmt.chunk(index, text, None, None, 0, False)
                self.text_offsets[index] = len(text)

    def before_finish(self, ev: StreamEvent) -> Iterator[dict[str, Any]]:
        if ev.index not in self.unechoed:
            return
        assert self.echo is not None and self.prompts is not None
        self.unechoed.discard(ev.index)
        prompt = None
        if ev.prompt_logprobs is not None:
            prompt = EchoedPrompt(self.prompts[ev.index], ev.prompt_logprobs, self.top)
        text = self.echo[ev.index]
        yield self.fmt.chunk(ev.index, text, None, None, 0, True, None, prompt)
        self.text_offsets[ev.index] = len(text)

    def after_finish(self, ev: StreamEvent) -> Iterator[dict[str, Any]]:
        token_ids = self.body.return_token_ids
        # with token ids, a token whose text is still held back gets a chunk too
        if not (
            ev.text
            or ev.finish_reason is not None
            or (self.want_logprobs and ev.logprobs)
            or (token_ids and ev.token_ids)
        ):
            return
        chunk = self.fmt.chunk(
            ev.index,
            ev.text,
            ev.finish_reason,
            ev.logprobs,
            self.text_offsets[ev.index],
            self.want_logprobs,
            ev.token_ids if token_ids else None,
        )
        self.text_offsets[ev.index] += len(ev.text)
        yield chunk

    def usage_chunk(self, generation: Generation) -> dict[str, Any]:
        return self.fmt.usage_chunk(self.usage(generation))

    def whole(self, results: list[ChoiceResult], usage_obj: dict[str, Any]) -> dict[str, Any]:
        body = self.body
        return self.fmt.completion(
            results,
            usage_obj,
            self.want_logprobs,
            body.return_token_ids,
            self.echo,
            self.prompts,
            self.top,
            body.prompt_logprobs,
        )
