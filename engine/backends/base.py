"""The `EngineBackend` protocol and the records that cross it: what the engine worker sees.

The seam between the pipeline (consumers/engine worker, embedded mode) and any engine
(torch, trtllm, sim). Requests go in through `submit`/`abort`; token deltas come out as
one batch per engine step from `deltas()`; `stats()` feeds backpressure, `health()` the
readiness probe. No torch here.

Delivery contract: every submitted request gets exactly one terminal delta (a delta
with `finish_reason` set), whether it finished, was aborted (even while still waiting),
passed its deadline, or the engine failed ('error'; `retryable` when the engine died
under it rather than the request being wrong). Deltas of one request arrive in order;
the terminal one carries the usage counts. A `RestartableBackend` can be started again
after its engine died (its `deltas()` ended).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from sluice.engine.errors import EngineDeadError, EngineError, RequestRejectedError
from sluice.engine.lora import LoRARequest
from sluice.engine.sampling import SamplingParams, SamplingParamsError

__all__ = [
    "DeltaChannel",
    "EngineBackend",
    "EngineDeadError",
    "EngineDelta",
    "EngineError",
    "EngineLogprob",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "LoRARequest",
    "RequestRejectedError",
    "RestartableBackend",
    "check_request",
    "terminal_delta",
]

logger = logging.getLogger(__name__)

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
    boundary included. lora_request: the LoRA adapter to run with (None: the base model);
    it crosses the engine-process pipe with the request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    deadline: float | None = None
    cache_salt: str | None = None
    num_resumed_tokens: int = 0
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class EngineLogprob:
    """The sampled (or prompt) token's raw logprob and the most likely alternatives, best
    first; `rank` (1 = most likely) is set for prompt tokens.

    The engine's own record, apart from the bus's wire `TokenLogprob`/`PromptLogprob`
    because the engine imports nothing of ours; `consumers.engine_outputs` converts."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class EngineDelta:
    """What one request gained in one engine step.

    token_ids are the new tokens, including the EOS or stop token that ended the request
    (they count as generated tokens); text is the new detokenized text, which never
    contains EOS, stop tokens or stop strings, and may lag token_ids while a possible stop
    string is held back. The terminal delta (finish_reason set) carries the usage counts;
    stop_reason is the stop string or stop token id that ended a 'stop' request.
    prompt_logprobs (`SamplingParams.prompt_logprobs`): one entry per prompt token, None
    for the first, on the request's first delta that has a token only.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[EngineLogprob] | None = None
    prompt_logprobs: list[EngineLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_output_tokens: int | None = None
    error: str | None = None  # with finish_reason 'error': what went wrong, for logs
    # with finish_reason 'error': the engine died under the request, which did nothing
    # wrong; it can run again (on a restarted engine, or elsewhere)
    retryable: bool = False
    # with finish_reason 'error': no engine came up to run it within the worker's wait
    # (`engine_wait_s`); the gateway answers 503, `error` being the cause and its fix
    unavailable: bool = False

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


@runtime_checkable
class RestartableBackend(EngineBackend, Protocol):
    """A backend whose engine can be started again after it died (a process killed)."""

    def restart(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start a fresh engine once `deltas()` has ended; blocks while it loads. Then
        `deltas()` is a new stream (read from `loop`). Raises EngineDeadError if it
        cannot start, or after `shutdown`."""
        ...


def check_request(request: EngineRequest, max_model_len: int, vocab_size: int | None) -> None:
    """What `submit` (and the engine core, as a request is added) rejects: anything that
    would fail inside an engine step, where it would take the whole batch down with it.

    vocab_size: the ids the model embeds; None (a fake runner) checks only for negatives.
    """
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if num_prompt == 0:
        raise RequestRejectedError("prompt is empty")
    if num_prompt >= max_model_len:
        raise RequestRejectedError(
            f"prompt has {num_prompt} tokens; max_model_len={max_model_len} allows at "
            f"most {max_model_len - 1}"
        )
    _check_token_ids("prompt", prompt, vocab_size)
    if not 0 <= request.num_resumed_tokens <= num_prompt:
        raise RequestRejectedError(
            f"num_resumed_tokens must be in [0, {num_prompt}], got {request.num_resumed_tokens}"
        )
    params = request.sampling_params
    try:
        params.validate()  # again: the params may have changed since they were built
    except SamplingParamsError as exc:
        raise RequestRejectedError(str(exc)) from None
    _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    _check_token_ids("logit_bias", list(params.logit_bias), vocab_size)


def _check_token_ids(what: str, token_ids: list[int], vocab_size: int | None) -> None:
    if not token_ids:
        return
    low, high = min(token_ids), max(token_ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        limit = "" if vocab_size is None else f" < {vocab_size} (the model's vocab_size)"
        raise RequestRejectedError(f"{what} has token id {bad}; ids must be >= 0{limit}")


class DeltaChannel:
    """Engine steps from a thread to the asyncio loop that reads them: one
    `call_soon_threadsafe` per step; None ends the stream."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[list[EngineDelta] | None] | None = None

    def open(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Bind to `loop` (default: the running one), which will read `stream()`."""
        self._loop = loop or asyncio.get_running_loop()
        self._queue = asyncio.Queue()

    def post(self, batch: list[EngineDelta] | None) -> None:
        """From any thread."""
        loop, queue = self._loop, self._queue
        assert loop is not None and queue is not None, "DeltaChannel.open() first"
        try:
            loop.call_soon_threadsafe(queue.put_nowait, batch)
        except RuntimeError:  # the consuming loop is closed: nobody is listening any more
            logger.warning("engine deltas dropped: the asyncio loop is closed")

    def stream(self) -> AsyncIterator[list[EngineDelta]]:
        return queued_batches(self._queue)


async def queued_batches(
    queue: asyncio.Queue[list[EngineDelta] | None] | None,
) -> AsyncIterator[list[EngineDelta]]:
    """The delta batches put on `queue` until None: a backend's `deltas()`."""
    if queue is None:
        raise RuntimeError("start() the engine before reading deltas()")
    while True:
        batch = await queue.get()
        if batch is None:
            return
        yield batch


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Run `fn` on `loop`: now when called from that loop, else soon, from its thread."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
    else:
        loop.call_soon_threadsafe(fn)


def terminal_delta(
    request: EngineRequest, finish_reason: FinishReason, error: str | None, retryable: bool = False
) -> EngineDelta:
    return EngineDelta(
        request.request_id,
        finish_reason=finish_reason,
        error=error,
        retryable=retryable,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=0,
        num_output_tokens=0,
    )
