"""The `EngineBackend` protocol and the records that cross it: what the engine worker sees.

The seam between the pipeline (consumers/engine worker, embedded mode) and any engine
(torch, trtllm, sim). Requests go in through `submit`/`abort`; token deltas come out as
one batch per engine step from `deltas()`; `stats()` feeds backpressure, `health()` the
readiness probe. No torch here.

Delivery contract: every submitted request gets exactly one terminal delta (a delta
with `finish_reason` set), whether it finished, was aborted (even while still waiting),
passed its deadline, or the engine failed ('error'). Deltas of one request arrive in
order; the terminal one carries the usage counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.errors import EngineDeadError, EngineError, RequestRejectedError
from engine.sampling import SamplingParams

__all__ = [
    "EngineBackend",
    "EngineDeadError",
    "EngineDelta",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "RequestRejectedError",
    "TokenLogprob",
]

FinishReason = Literal["stop", "length", "abort", "deadline", "error"]


@dataclass(slots=True)
class EngineRequest:
    """One generation request as submitted to a backend.

    priority: lower value is served first (vLLM convention); only honoured under the
    'priority' scheduling policy. deadline: absolute `time.monotonic()` seconds (the worker
    converts the wall-clock deadline of a GenerateRequest). cache_salt: per tenant, keeps
    prefix-cache hits within the tenant. num_resumed_tokens: the last this-many prompt
    tokens are output of an earlier attempt (a failover resume), so the text continues
    exactly where that attempt's stopped, a multi-byte character split across the
    boundary included.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    deadline: float | None = None
    cache_salt: str | None = None
    num_resumed_tokens: int = 0


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's raw logprob and the most likely alternatives, best first."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class EngineDelta:
    """What one request gained in one engine step.

    token_ids are the new tokens, including the EOS or stop token that ended the request
    (they count as generated tokens); text is the new detokenized text, which never
    contains EOS, stop tokens or stop strings, and may lag token_ids while a possible stop
    string is held back. The terminal delta (finish_reason set) carries the usage counts;
    stop_reason is the stop string or stop token id that ended a 'stop' request.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_output_tokens: int | None = None
    error: str | None = None  # with finish_reason 'error': what went wrong, for logs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot for backpressure and metrics, taken after the latest step."""

    num_waiting: int = 0  # in the scheduler's queue, preempted ones included
    num_running: int = 0
    num_pending: int = 0  # submitted, not yet drained into the scheduler
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class EngineBackend(Protocol):
    """An inference engine as the pipeline drives it. All methods are thread-safe.

    `start` is called from the asyncio loop that will consume `deltas()`; `deltas()` has
    one consumer and yields one list per engine step (coalesced over requests); it ends
    after `shutdown` or when the engine dies.
    """

    def start(self) -> None: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...

    def submit(self, request: EngineRequest) -> None:
        """Queue a request; raises RequestRejectedError or EngineDeadError, never blocks."""
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request; unknown or finished ids are ignored."""
        ...

    def deltas(self) -> AsyncIterator[list[EngineDelta]]: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> bool:
        """False once the engine loop has died (or was never started / is shut down)."""
        ...
