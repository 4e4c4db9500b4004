"""Validated request bodies → `GenerateRequest`s: tokenize, check limits, pick the lane.

Everything the routes share before a request goes on the bus: chat templates and
tokenization (at the gateway, docs/architecture.md §4), the context-length check, sampling
parameters, the `service_tier` → lane mapping, and the deadline.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.api.auth import Principal
from sluice.api.errors import ContextLengthExceeded, InvalidRequest
from sluice.api.served import ServedModel
from sluice.bus.messages import GenerateRequest, SamplingSpec
from sluice.bus.topics import Lane

TIMEOUT_HEADER = "x-sluice-timeout-ms"

# service_tier → (lane, the tier echoed back); "auto" is "default" (as at OpenAI)
_TIERS: dict[str | None, tuple[Lane, str]] = {
    None: (Lane.STANDARD, "default"),
    "auto": (Lane.STANDARD, "default"),
    "default": (Lane.STANDARD, "default"),
    "scale": (Lane.STANDARD, "default"),
    "priority": (Lane.INTERACTIVE, "priority"),
    "fast": (Lane.INTERACTIVE, "priority"),
    "flex": (Lane.BATCH, "flex"),
}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The gateway's limits on one request, each default written here once (the gateway's
    settings take theirs from it); a tenant's plan limits are `storage.tenants.PlanLimits`."""

    request_timeout_s: float = 600.0
    max_n: int = 8
    max_choices: int = 64
    max_logprobs: int = 20


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP/WS call, ready for `GatewayService.submit`."""

    call_id: str  # hex; also the request id of the first sub-request
    requests: list[GenerateRequest]
    prompt_lengths: list[int]  # one per distinct prompt (usage counts each once)
    tier: str
    deadline_ms: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)


def lane_for(service_tier: str | None) -> tuple[Lane, str]:
    return _TIERS[service_tier]


def deadline_ms_for(headers: Any, limits: RequestLimits, now_ms: int) -> int:
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return now_ms + int(limits.request_timeout_s * 1000)
    try:
        timeout_ms = int(raw)
    except ValueError:
        timeout_ms = 0
    if timeout_ms <= 0:
        raise InvalidRequest(
            f"{TIMEOUT_HEADER} must be a positive integer of milliseconds, got {raw!r}",
            param=TIMEOUT_HEADER,
            code="invalid_value",
        )
    return now_ms + timeout_ms


def message_text(content: str | list[dict[str, Any]] | None, param: str) -> str:
    """Chat/Responses content as text; only text parts are supported."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.get("type") not in {"text", "input_text", "output_text"} or not isinstance(
            part.get("text"), str
        ):
            raise InvalidRequest(
                f"only text content parts are supported, got {part.get('type')!r}",
                param=f"{param}[{i}]",
                code="unsupported_content",
            )
        parts.append(part["text"])
    return "".join(parts)


def check_prompt_chars(model: ServedModel, num_chars: int, param: str) -> None:
    """Refuse text that could not fit the context however it tokenizes, before tokenizing.

    No token covers more than `max_token_chars` characters, so longer text needs more
    tokens than the context holds; tokenizing megabytes first would only burn a core.
    """
    limit = model.max_model_len * max(1, model.tokenizer.max_token_chars)
    if num_chars > limit:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {model.max_model_len} tokens; the "
            f"prompt has {num_chars} characters, more than that many tokens can hold: "
            "shorten the prompt",
            param=param,
        )


def check_token_ids(model: ServedModel, token_ids: Sequence[int], param: str) -> None:
    vocab_size = model.tokenizer.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside this model's vocabulary (0 to {vocab_size - 1})",
            param=param,
            code="invalid_value",
        )


def render_chat(
    model: ServedModel, messages: list[dict[str, Any]], variables: dict[str, Any] | None = None
) -> list[int]:
    """The prompt's token ids; `variables` go to the template too (`tools`)."""
    num_chars = sum(len(m["content"] or "") for m in messages)
    if variables:
        num_chars += len(json.dumps(variables))
    check_prompt_chars(model, num_chars, "messages")
    try:
        rendered = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **(variables or {})
        )
    except ValueError as exc:  # engine TokenizerError is a ValueError
        raise InvalidRequest(f"the chat template failed: {exc}", param="messages") from exc
    if isinstance(rendered, str):
        return model.tokenizer.encode(rendered, add_special_tokens=False)
    return list(rendered)


def encode_prompts(model: ServedModel, prompt: Any) -> list[list[int]]:
    """Completions' `prompt`: text, token ids, or a list of either."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        for text in prompt:
            check_prompt_chars(model, len(text), "prompt")
        return [model.tokenizer.encode(p) for p in prompt]
    for token_ids in prompt:
        check_token_ids(model, token_ids, "prompt")
    return [list(p) for p in prompt]


def check_prompt(model: ServedModel, prompt_ids: list[int], max_tokens: int, param: str) -> None:
    if not prompt_ids:
        raise InvalidRequest("the prompt has no tokens", param=param, code="invalid_value")
    total = len(prompt_ids) + max_tokens
    if total > model.max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {model.max_model_len} tokens; "
            f"the request has {len(prompt_ids)} prompt tokens and asks for up to "
            f"{max_tokens} more ({total} in all): shorten the prompt or lower max_tokens",
            param=param,
        )


def check_sampling(model: ServedModel, sampling: SamplingSpec) -> None:
    """What the engine would otherwise have to refuse mid-batch."""
    if sampling.top_p < sys.float_info.min:
        # the engine flushes subnormal floats to zero, and top_p 0 is out of its range
        raise InvalidRequest(
            f"top_p must be at least {sys.float_info.min} (the smallest normal float)",
            param="top_p",
            code="invalid_value",
        )
    if sampling.repetition_penalty < sys.float_info.min:
        # a subnormal penalty divides logits into infinities
        raise InvalidRequest(
            f"repetition_penalty must be at least {sys.float_info.min} (the smallest normal float)",
            param="repetition_penalty",
            code="invalid_value",
        )
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequest(
            f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens "
            f"({sampling.max_tokens})",
            param="min_tokens",
            code="invalid_value",
        )
    check_token_ids(model, sampling.stop_token_ids, "stop_token_ids")


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise InvalidRequest("stop takes at most 4 sequences", param="stop", code="invalid_value")
    return [s for s in stops if s]


def refuse(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {what}", param=param, code="unsupported_parameter")


def check_common(body: Any, limits: RequestLimits) -> None:
    """Parameters shared by chat and completions that Sluice cannot honour."""
    if body.n > limits.max_n:
        raise InvalidRequest(f"n must be at most {limits.max_n}", param="n", code="invalid_value")
    if body.min_p:
        raise refuse("min_p", "min_p is not supported by this server; use 0")
    if body.prompt_logprobs is not None:
        check_logprobs(body.prompt_logprobs, limits, "prompt_logprobs")
        if body.stream:  # as vLLM: they belong to the whole answer
            raise refuse("prompt_logprobs", "prompt_logprobs are not available with stream")


LOGIT_BIAS_LIMIT = 100.0


def logit_bias(model: ServedModel, bias: dict[str, float] | None) -> dict[int, float]:
    """`logit_bias` with its keys as token ids: each an integer id in the vocabulary, each
    value in [-100, 100] (OpenAI's range), else a 400 naming logit_bias."""
    out: dict[int, float] = {}
    vocab_size = model.tokenizer.vocab_size
    for key, value in (bias or {}).items():
        token = key
        if not token.isascii() or not token.isdigit() or not 0 <= int(token) < vocab_size:
            raise InvalidRequest(
                f"logit_bias: key {key[:40]!r} is not a token id of this model (an integer "
                f"from 0 to {vocab_size - 1})",
                param="logit_bias",
                code="invalid_value",
            )
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InvalidRequest(
                f"logit_bias: the bias of token {token} is {value}; it must be in [-100, 100]",
                param="logit_bias",
                code="invalid_value",
            )
        out[int(token)] = float(value)
    return out


def sampling_fields(body: Any, model: ServedModel) -> dict[str, Any]:
    """The SamplingSpec fields a chat and a completions body give alike (the defaults
    for what the body leaves out included); each route adds its token counts."""
    return {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": max(0, body.top_k or 0),
        "seed": body.seed,
        "min_tokens": body.min_tokens,
        "stop": stop_list(body.stop),
        "stop_token_ids": body.stop_token_ids or [],
        "ignore_eos": body.ignore_eos,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "presence_penalty": body.presence_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": logit_bias(model, body.logit_bias),
    }


def check_logprobs(count: int | None, limits: RequestLimits, param: str) -> None:
    if count is not None and count > limits.max_logprobs:
        raise InvalidRequest(
            f"{param} must be at most {limits.max_logprobs}", param=param, code="invalid_value"
        )


def _int64(value: int) -> int:
    """Wrapped into the signed 64-bit range seeds travel in."""
    return (value + 2**63) % 2**64 - 2**63


def build_call(
    *,
    principal: Principal,
    model: ServedModel,
    prompts: Sequence[list[int]],
    n: int,
    sampling: SamplingSpec,
    service_tier: str | None,
    deadline_ms: int,
    reply_to: str,
    limits: RequestLimits,
    call_id: str | None = None,
    reply_beats: bool = False,
) -> Call:
    """One GenerateRequest per (prompt, choice); seeds differ per choice so n > 1 varies."""
    check_sampling(model, sampling)
    if len(prompts) * n > limits.max_choices:
        raise InvalidRequest(
            f"at most {limits.max_choices} choices per request (prompts x n)",
            param="n",
            code="invalid_value",
        )
    lane, tier = lane_for(service_tier)
    call_id = call_id or uuid.uuid4().hex
    now_ms = int(time.time() * 1000)
    requests = []
    for p, prompt_ids in enumerate(prompts):
        for c in range(n):
            i = p * n + c
            spec = sampling
            if sampling.seed is not None and c > 0:
                spec = sampling.model_copy(update={"seed": _int64(sampling.seed + c)})
            requests.append(
                GenerateRequest(
                    request_id=f"req_{call_id}" if i == 0 else f"req_{call_id}-{i}",
                    tenant_id=principal.tenant_id,
                    key_id=principal.key_id,
                    model=model.base_name,
                    adapter=model.adapter,
                    lane=lane,
                    prompt_token_ids=prompt_ids,
                    sampling=spec,
                    deadline_ms=deadline_ms,
                    reply_to=reply_to,
                    reply_beats=reply_beats,
                    created_ms=now_ms,
                    cache_salt=principal.tenant_id,
                    bill_prompt=c == 0,
                )
            )
    return Call(
        call_id=call_id,
        requests=requests,
        prompt_lengths=[len(p) for p in prompts],
        tier=tier,
        deadline_ms=deadline_ms,
    )
