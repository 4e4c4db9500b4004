"""`SimEngineBackend`: a modelled GPU behind `EngineBackend`, for load tests without one.

Where the pipeline meets the sim engine (SLUICE_BACKEND=sim): the same contract as the
torch backend (engine.backends.base), served by an asyncio task on the loop that reads
`deltas()`. Each step, the task applies the submits and aborts that arrived, lets
`sim.core.SimCore` schedule the step (continuous batching, chunked prefill, KV blocks
with preemption, prefix-cache hits), sleeps the step's modelled time (`sim.presets`:
calibrated to published TensorRT-LLM figures), then emits one token per request that
finished its prefill or decode. It is a model of a GPU, not a
measurement: nothing is computed, so it uses almost no CPU and never imports torch.

Steps are timed on a running schedule: a step starts when the previous one was due to
end (now, after idling), so a late wake-up of the loop (a busy host) does not slow the
modelled GPU: the next steps catch up, up to `_MAX_CATCH_UP_S` behind.
`kill(error)` makes the loop die as an engine would: in-flight requests end with a
retryable 'error', `health()` turns False, `submit` raises EngineDeadError and
`deltas()` ends. At `shutdown`, in-flight requests end with 'abort'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from sluice.engine.backends.base import (
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestRejectedError,
    call_on_loop,
    check_request,
    queued_batches,
    terminal_delta,
)
from sluice.engine.backends.sim.core import SimCore
from sluice.engine.backends.sim.presets import DEFAULT_PRESET, SIM_PRESETS, SimPreset

__all__ = ["SIM_PRESETS", "SimEngineBackend", "SimPreset"]

logger = logging.getLogger(__name__)

_SIM_VOCAB_SIZE = 128_256  # Llama 3's, when no tokenizer says otherwise
_MAX_CATCH_UP_S = 0.1  # further behind than this, the host stalled: restart the schedule


class SimEngineBackend:
    """The sim engine; see the module docstring for the contract.

    preset: a `SimPreset` or its name in `SIM_PRESETS`. max_model_len: the served model's
    (default: the preset's). tokenizer: the served model's, for the text of the emitted
    tokens and the ids `submit` accepts (`vocab_size`, `eos_token_ids` otherwise).
    eos_probability: the chance a token is EOS once min_tokens are out (never with
    ignore_eos); 0 runs every request to max_tokens. clock, sleep: the loop's time and
    how a step waits out its modelled time (the event loop's by default); a test injects
    a virtual pair to see the modelled times without waiting them.
    """

    def __init__(
        self,
        preset: SimPreset | str = DEFAULT_PRESET,
        *,
        max_model_len: int | None = None,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        eos_probability: float = 0.0,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        if isinstance(preset, str):
            if preset not in SIM_PRESETS:
                raise ValueError(f"unknown sim preset {preset!r}; one of {sorted(SIM_PRESETS)}")
            preset = SIM_PRESETS[preset]
        self.preset = preset
        self.tokenizer = tokenizer
        if vocab_size is None:
            vocab_size = tokenizer.vocab_size if tokenizer is not None else _SIM_VOCAB_SIZE
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", ())
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len or preset.max_model_len
        decode: Callable[[int], str] | None = None
        if tokenizer is not None:
            decode = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
        self.core = SimCore(
            preset,
            max_model_len=self.max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            detokenize=decode,
            eos_probability=eos_probability,
        )
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, Any]] = []  # ("add", EngineRequest) | ("abort", id)
        self._idle = False  # the loop waits for `_wake`: a submit must set it
        self._stopping = False
        self._closed = False
        self._kill: BaseException | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[list[EngineDelta] | None] | None = None
        self._wake: asyncio.Event | None = None
        self._done = threading.Event()
        self._stats = EngineStats(num_kv_blocks=preset.num_kv_blocks)

    # -- lifecycle -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._loop is not None:
            raise RuntimeError("engine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._queue, self._wake = asyncio.Queue(), asyncio.Event()
        call_on_loop(self._loop, self._begin)

    def _begin(self) -> None:
        assert self._loop is not None
        self._loop_thread = threading.get_ident()
        self._task = self._loop.create_task(self._run(), name="sluice-sim-engine")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        loop = self._loop
        if loop is None or self._done.is_set():
            return
        if threading.get_ident() == self._loop_thread:
            # on the loop itself the task cannot run while we wait: end everything here
            self._end("abort", "engine shut down")
            if self._task is not None:
                self._task.cancel()
            return
        try:
            loop.call_soon_threadsafe(self._wake_up)
        except RuntimeError:  # the loop is closed: nobody reads deltas any more
            self._end("abort", "engine shut down")
            return
        if not self._done.wait(timeout_s):
            logger.warning("sim engine did not stop within %.1fs", timeout_s)

    def kill(self, error: BaseException | None = None) -> None:
        """Make the engine loop die at its next step, as a crashed engine would."""
        with self._lock:
            self._kill = error or RuntimeError("sim engine killed")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_up)

    def health(self) -> bool:
        task = self._task
        return task is not None and not task.done() and self._error is None and not self._stopping

    @property
    def error(self) -> BaseException | None:
        """What killed the engine loop, if it died."""
        return self._error

    # -- requests in -----------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        check_request(request, self.max_model_len, self.vocab_size)
        # its tokens are a model's stand-ins: no grammar could hold them (penalties and
        # logit_bias are accepted and, like temperature, change nothing here)
        if request.sampling_params.constraint is not None:
            raise RequestRejectedError("the sim backend has no structured outputs")
        if request.sampling_params.prompt_logprobs is not None:
            raise RequestRejectedError("the sim backend has no prompt_logprobs")
        self.core.check_fits(request)
        self._post(("add", request), dead_error=True)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id), dead_error=False)

    def _post(self, command: tuple[str, Any], *, dead_error: bool) -> None:
        with self._lock:
            if self._closed or self._stopping:
                if dead_error:
                    raise EngineDeadError("engine is not running") from self._error
                return
            self._inbox.append(command)
            idle, self._idle = self._idle, False
        if idle and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_up)

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- deltas out ------------------------------------------------------------------
    def deltas(self) -> AsyncIterator[list[EngineDelta]]:
        return queued_batches(self._queue)

    def stats(self) -> EngineStats:
        stats = self._stats
        num_pending = len(self._inbox)
        if num_pending == stats.num_pending:
            return stats
        return dataclasses.replace(stats, num_pending=num_pending)

    def _publish(self, batch: list[EngineDelta] | None) -> None:
        assert self._queue is not None
        self._queue.put_nowait(batch)

    # -- the engine loop -------------------------------------------------------------
    async def _run(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        clock = self._clock or loop.time
        due = clock()  # when the latest step ends on the modelled GPU
        try:
            while True:
                with self._lock:
                    commands, self._inbox = self._inbox, []
                    if self._kill is not None:
                        raise self._kill
                    if self._stopping:
                        break
                    idle = not commands and not core.has_unfinished()
                    self._idle = idle
                if idle:
                    wake.clear()
                    await wake.wait()
                    due = clock()
                    continue
                batch = self._apply(commands)
                batch.extend(core.expire(time.monotonic()))
                step = core.schedule()
                if step.scheduled:
                    now = clock()
                    due = max(due, now - _MAX_CATCH_UP_S) + step.time_s
                    await self._sleep(due - now)
                    if self._closed:
                        return  # shut down from the loop while this step ran
                    batch.extend(core.finish_step(step))
                else:  # nothing ran (all preempted, or just ended): let the loop breathe
                    await asyncio.sleep(0)
                self._stats = self._snapshot()
                if batch:
                    self._publish(batch)
        except asyncio.CancelledError:
            if not self._closed:
                self._end("abort", "engine shut down")
        except BaseException as exc:
            logger.exception("sim engine loop died")
            self._error = exc
            self._end("error", f"engine failed: {type(exc).__name__}: {exc}")
        else:
            self._end("abort", "engine shut down")

    def _apply(self, commands: list[tuple[str, Any]]) -> list[EngineDelta]:
        """Adds and aborts in arrival order."""
        out: list[EngineDelta] = []
        for kind, payload in commands:
            if kind == "abort":
                delta = self.core.abort(payload)
                if delta is not None:
                    out.append(delta)
            elif not self.core.add(payload):
                # at-least-once delivery can hand us a request twice: keep the first
                logger.warning("request_id=%s submitted twice; ignored", payload.request_id)
        return out

    def _snapshot(self) -> EngineStats:
        core = self.core
        return EngineStats(
            num_waiting=len(core.waiting),
            num_running=len(core.running),
            num_pending=len(self._inbox),
            kv_usage=core.kv.usage,
            num_kv_blocks=core.kv.num_blocks,
            num_preemptions=core.num_preemptions,
            num_steps=core.num_steps,
            num_generated_tokens=core.num_generated_tokens,
            num_prompt_tokens=core.num_prompt_tokens,
            num_cached_tokens=core.num_cached_tokens,
        )

    def _end(self, finish_reason: FinishReason, message: str) -> None:
        """End every in-flight and pending request, then end `deltas()` (once)."""
        with self._lock:
            if self._closed:
                return
            pending, self._inbox, self._closed = self._inbox, [], True
        error = message if finish_reason == "error" else None
        died = error is not None  # the loop died under these requests: they may run again
        live = self.core.requests
        deltas = [
            terminal_delta(p, finish_reason, error, died)
            for k, p in pending
            if k == "add" and p.request_id not in live
        ]
        deltas.extend(self.core.abort_all(finish_reason, error))
        for delta in deltas:
            delta.retryable = died
        self._stats = self._snapshot()
        if deltas:
            self._publish(deltas)
        self._publish(None)
        self._done.set()
        logger.info("sim engine loop stopped: %s", message)
