"""How one engine step of the requests an engine worker holds becomes messages.

Sits between the engine's `deltas()` stream and the bus: one engine step (a list of
`EngineDelta`s) turns into one `DeltaPart` per request, grouped by reply target, which
`StepPublisher` sends as one `TokenDeltaBatch` per target (not one message per token or
per request; it may hold mid-stream parts and merge several steps' per request),
one `UsageRecord` per finished attempt (keyed by tenant), one `TelemetryRecord` per
finished attempt, and the `StepProgress` entries the progress store records once the
publishes are confirmed.

The engine's own records (`engine.backends.base.FinishReason`, `EngineLogprob`) become the
bus's here and only here: `to_bus_finish_reason`, `to_bus_logprobs`,
`to_bus_prompt_logprobs` (the engine does not import the bus).

Offsets are absolute across attempts: a resumed attempt starts at the tokens and text
that earlier attempts published, so the gateway can drop what it already delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import assert_never

from sluice.bus.messages import (
    ENGINE_UNAVAILABLE,
    FinishReason,
    PromptLogprob,
    TelemetryRecord,
    Timings,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
    UsageRecord,
)
from sluice.consumers.progress import StepProgress
from sluice.consumers.work_item import EndKind, EndReason, WorkItem, now_ms
from sluice.engine.backends.base import EngineDelta, EngineLogprob
from sluice.engine.backends.base import FinishReason as EngineFinishReason


def to_bus_finish_reason(reason: EngineFinishReason) -> FinishReason:
    """The bus's finish reason for the engine's (the same five words today)."""
    match reason:
        case "stop" | "length" | "abort" | "deadline" | "error":
            return reason
        case _:
            assert_never(reason)


def to_bus_prompt_logprobs(
    logprobs: list[EngineLogprob | None],
) -> list[PromptLogprob | None]:
    """The bus's prompt logprob records for the engine's (None stays None: the first)."""
    return [
        None
        if lp is None
        else PromptLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            rank=lp.rank if lp.rank is not None else 0,
            top=[TopLogprob(token_id=t, logprob=p) for t, p in lp.top_logprobs],
        )
        for lp in logprobs
    ]


def to_bus_logprobs(logprobs: list[EngineLogprob]) -> list[TokenLogprob]:
    """The bus's logprob records for the engine's, in order."""
    return [
        TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[TopLogprob(token_id=t, logprob=p) for t, p in lp.top_logprobs],
        )
        for lp in logprobs
    ]


@dataclass(slots=True)
class DeltaPart:
    """One step's output for one request, kept as the engine gave it until its reply
    message is built (`render`): deltas held for the reply interval are merged there, so
    each request costs one `TokenDelta` per message, not one per step."""

    item: WorkItem
    delta: EngineDelta
    seq_no: int
    token_offset: int  # absolute position of this part's first token
    text_offset: int

    @property
    def urgent(self) -> bool:
        """An attempt's first delta (the client's first token) or its last never waits."""
        return self.seq_no == 0 or self.delta.finished


@dataclass(slots=True)
class StepOutput:
    """The messages and progress of one step, grouped for publishing."""

    batches: dict[str, list[DeltaPart]] = field(default_factory=dict)  # reply_to → parts
    usage: list[UsageRecord] = field(default_factory=list)
    telemetry: list[TelemetryRecord] = field(default_factory=list)
    progress: list[StepProgress] = field(default_factory=list)
    finished: list[WorkItem] = field(default_factory=list)


def build_step(
    pairs: list[tuple[WorkItem, EngineDelta]], worker_id: str, model_name: str | None = None
) -> StepOutput:
    """Advance each item by its delta and collect what must be published."""
    out = StepOutput()
    for item, delta in pairs:
        token_offset, text_offset = item.token_offset, item.text_offset
        _advance(item, delta)
        if delta.finished:
            item.finishing()
            out.finished.append(item)
            # an attempt ended silently (lost, fenced, stopped, handed over) bills through
            # the attempt that resumes it (`superseded_usage`), not a record of its own
            if not item.silent:
                timings = _timings(item)
                usage = usage_record(item, delta, timings)
                out.usage.append(usage)
                out.telemetry.append(telemetry_record(item, usage, worker_id))
        if item.silent:
            continue
        if delta.token_ids or delta.text or delta.finished:
            part = DeltaPart(item, delta, item.seq_no, token_offset, text_offset)
            out.batches.setdefault(item.request.reply_to, []).append(part)
            item.seq_no += 1
        out.progress.append(
            StepProgress(
                item.request_id,
                item.attempt,
                token_offset,
                list(delta.token_ids),
                item.text_offset,
                delta.finished,
            )
        )
    return out


def render(parts: list[DeltaPart]) -> list[TokenDelta]:
    """The deltas of one reply message, one per request attempt: a request's parts held
    over several steps (`consumers.engine_publisher`) become one delta, their tokens, text
    and logprobs in order, at the first one's offsets, with the last one's seq_no and
    ending.

    The gateway takes a delta only above the last seq_no it took, and cuts what precedes
    the tokens it has by the offsets, so one merged delta reads as its parts would. Fewer,
    larger deltas cost the encoder and every reader less, and each delivery of a request
    is one event (with the parts, a reader would take the 0 ms gaps between a message's
    deltas for inter-token latency). The delta is built here, once per message, rather
    than per step and merged: per-step construction is a large share of the publisher's
    CPU.
    """
    groups: dict[tuple[str, int], list[DeltaPart]] = {}
    for part in parts:
        groups.setdefault((part.item.request_id, part.item.attempt), []).append(part)
    return [_token_delta(group) for group in groups.values()]


def _advance(item: WorkItem, delta: EngineDelta) -> None:
    if delta.token_ids and item.first_token_ms is None:
        item.first_token_ms = now_ms()
    item.token_offset += len(delta.token_ids)
    item.text_offset += len(delta.text)
    item.num_generated += len(delta.token_ids)


def _token_delta(parts: list[DeltaPart]) -> TokenDelta:
    first, last = parts[0], parts[-1]
    item, delta = last.item, last.delta
    finish = delta.finish_reason
    usage = None
    if delta.finished:  # nothing follows a terminal part: item.token_offset is final
        prompt_tokens, cached_tokens = billed_prompt(item, delta)
        usage = Usage(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=item.token_offset,  # the whole completion, all attempts
        )
    logprobs = None
    if any(p.delta.logprobs is not None for p in parts):
        logprobs = to_bus_logprobs([lp for p in parts for lp in p.delta.logprobs or ()])
    prompt_logprobs = None  # on the engine's first token delta: an attempt's first part
    if first.delta.prompt_logprobs is not None:
        prompt_logprobs = to_bus_prompt_logprobs(first.delta.prompt_logprobs)
    if len(parts) == 1:
        token_ids, text = list(delta.token_ids), delta.text
    else:
        token_ids = [t for p in parts for t in p.delta.token_ids]
        text = "".join(p.delta.text for p in parts)
    # validated, not model_construct: pydantic's validator (compiled) builds the model in
    # less CPU than model_construct's Python loop over the fields
    return TokenDelta(
        request_id=item.request_id,
        attempt=item.attempt,
        seq_no=last.seq_no,
        token_offset=first.token_offset,
        text_offset=first.text_offset,
        token_ids=token_ids,
        text=text,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        finish_reason=None if finish is None else to_bus_finish_reason(finish),
        error=_client_error(delta),
        error_code=ENGINE_UNAVAILABLE if delta.unavailable else None,
        usage=usage,
    )


def _client_error(delta: EngineDelta) -> str | None:
    if delta.finish_reason != "error":
        return None
    return delta.error or "the engine failed to generate this request"


def billed_prompt(item: WorkItem, delta: EngineDelta) -> tuple[int, int]:
    """The (prompt, cached) tokens a request's ending attempt bills, and its client is
    shown: its prompt once per request, by the attempt that ends it, whichever attempt ran
    it (superseded attempts bill only the tokens they published, `superseded_usage`).
    None when the prompt never ran, nor for the later choices of one prompt (n > 1:
    `GenerateRequest.bill_prompt`), as OpenAI bills them."""
    request = item.request
    ran = bool(delta.num_prompt_tokens) or item.num_generated > 0 or bool(item.resumed_token_ids)
    if not ran or not request.bill_prompt:
        return 0, 0
    prompt_tokens = len(request.prompt_token_ids)
    return prompt_tokens, min(delta.num_cached_tokens or 0, prompt_tokens)


def _timings(item: WorkItem) -> Timings:
    return Timings(
        queued_ms=item.request.created_ms or item.received_ms,
        scheduled_ms=item.scheduled_ms,
        first_token_ms=item.first_token_ms,
        finished_ms=now_ms(),
        received_ms=item.received_ms,
        admitted_ms=item.admitted_ms,
    )


def usage_record(item: WorkItem, delta: EngineDelta, timings: Timings) -> UsageRecord:
    """What the attempt that ends a request bills: the request's prompt
    (`billed_prompt`) and the tokens this attempt generated. With the superseded
    attempts' records, it sums to the usage on the terminal delta, what the client is
    shown (docs/architecture.md §5.4)."""
    prompt_tokens, cached_tokens = billed_prompt(item, delta)
    completion = delta.num_output_tokens
    return _usage(
        item,
        item.attempt,
        prompt_tokens,
        cached_tokens,
        item.num_generated if completion is None else completion,
        to_bus_finish_reason(delta.finish_reason or "abort"),
        timings,
    )


def superseded_usage(
    item: WorkItem, attempt: int, completion_tokens: int, *, ended: bool = False
) -> UsageRecord:
    """The usage of an earlier attempt whose own record may never come: the tokens the
    progress store confirms it published, which the client received and the attempt
    resuming it does not generate again. An attempt that ended without ending the request
    (its worker killed, lost the request or was fenced; its engine dead) bills no prompt:
    the attempt that ends the request bills it once (`billed_prompt`), and the prompt each
    attempt recomputes is the operator's cost. One that `ended` the request (its worker
    died between recording the finish and publishing its usage) bills the prompt too, its
    cached part unknown. Marked `estimated`: should the attempt's own record arrive too,
    the ledger keeps that one."""
    request = item.request
    timings = Timings(queued_ms=request.created_ms or item.received_ms, finished_ms=now_ms())
    prompt = len(request.prompt_token_ids) if ended and request.bill_prompt else 0
    finish: FinishReason = "error"
    if ended:
        finish = "length" if completion_tokens >= request.sampling.max_tokens else "stop"
    usage = _usage(item, attempt, prompt, 0, completion_tokens, finish, timings)
    return usage.model_copy(update={"estimated": True})


def _usage(
    item: WorkItem,
    attempt: int,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    finish_reason: FinishReason,
    timings: Timings,
) -> UsageRecord:
    request = item.request
    return UsageRecord(
        request_id=request.request_id,
        attempt=attempt,
        tenant_id=request.tenant_id,
        key_id=request.key_id,
        model=request.model,
        lane=request.lane,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason,
        timings=timings,
        batch_id=request.batch_id,
    )


def telemetry_record(item: WorkItem, usage: UsageRecord, worker_id: str) -> TelemetryRecord:
    """The spans' record of one attempt: its timings, and its token counts as its usage
    record bills them (the GenAI conventions want billable tokens)."""
    request = item.request
    return TelemetryRecord(
        request_id=usage.request_id,
        attempt=usage.attempt,
        tenant_id=usage.tenant_id,
        model=usage.model,
        lane=usage.lane,
        worker_id=worker_id,
        timings=usage.timings,
        num_prompt_tokens=usage.prompt_tokens,
        num_output_tokens=usage.completion_tokens,
        key_id=usage.key_id,
        batch_id=usage.batch_id,
        max_tokens=request.sampling.max_tokens,
        num_cached_tokens=usage.cached_tokens,
        finish_reason=usage.finish_reason,
        estimated=usage.estimated,
    )


def superseded_telemetry(
    item: WorkItem, attempt: int, completion_tokens: int, worker_id: str
) -> TelemetryRecord:
    """The telemetry of an earlier attempt whose worker died, published with its usage
    (`superseded_usage`) by `worker_id`, the worker resuming it: the tokens the progress
    store confirms, from the request's creation until now (nothing of its scheduling is
    known)."""
    return telemetry_record(item, superseded_usage(item, attempt, completion_tokens), worker_id)


def unrun_terminal(item: WorkItem, reason: EndReason) -> EngineDelta:
    """A terminal delta for a request answered without running (cancelled, expired...)."""
    return EngineDelta(
        item.request_id,
        finish_reason=reason.finish_reason,
        error=reason.detail,
        unavailable=reason.kind is EndKind.UNAVAILABLE,
        num_prompt_tokens=0,
        num_cached_tokens=0,
        num_output_tokens=0,
    )
