"""From a `GenerateRequest` (wire) to an `EngineRequest` (engine), resumption included.

Sits at the engine worker's edge towards the engine: maps sampling parameters, turns the
wall-clock deadline into the engine's monotonic one, and, for an attempt that resumes a
failed-over request, submits prompt + the tokens already published with `max_tokens`
(and `min_tokens`) reduced by as many. The engine treats those resumed tokens as output:
penalties count them and a grammar replays them before its first token.
"""

from __future__ import annotations

import time

from sluice.consumers.work_item import WorkItem
from sluice.engine.backends.base import EngineRequest, LoRARequest
from sluice.engine.sampling import Constraint, SamplingParams

LANE_PRIORITY = {"interactive": 0, "standard": 1, "batch": 2}  # lower runs first


def deadline_to_monotonic(deadline_ms: int | None) -> float | None:
    """Unix epoch milliseconds → `time.monotonic()` seconds (None stays None)."""
    if deadline_ms is None:
        return None
    return time.monotonic() + (deadline_ms / 1000.0 - time.time())


def is_expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def engine_request(item: WorkItem) -> EngineRequest:
    """The request as this attempt submits it (raises SamplingParamsError if invalid)."""
    request = item.request
    spec = request.sampling
    structured = spec.structured
    resumed = len(item.resumed_token_ids)
    params = SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed,
        max_tokens=spec.max_tokens - resumed,
        min_tokens=max(0, spec.min_tokens - resumed),
        stop=list(spec.stop),
        stop_token_ids=list(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
        logprobs=spec.logprobs,
        frequency_penalty=spec.frequency_penalty,
        presence_penalty=spec.presence_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=dict(spec.logit_bias),
        # an attempt that resumes has echoed its prompt already (the first attempt's)
        prompt_logprobs=None if resumed else spec.prompt_logprobs,
        constraint=None if structured is None else Constraint(**structured.model_dump()),
    )
    return EngineRequest(
        request_id=request.request_id,
        prompt_token_ids=[*request.prompt_token_ids, *item.resumed_token_ids],
        sampling_params=params,
        priority=LANE_PRIORITY.get(request.lane.value, 1),
        deadline=item.deadline,
        cache_salt=request.cache_salt,
        num_resumed_tokens=resumed,
        lora_request=None
        if request.adapter is None
        else LoRARequest(request.adapter.name, request.adapter.path),
    )
