"""`PerRequestBackend`: the skeleton of a backend that serves each request as an asyncio task.

For engines driven one request at a time through an async API (TensorRT-LLM's
`generate_async`, an upstream server's streamed completion): the subclass says how one
request runs (`_generate`) and what its failures mean (`_failed`); this class does the
rest of the `EngineBackend` contract on the loop that reads `deltas()`.

`submit` records the request as pending and hands it to the loop, where it becomes a
task (one already past its deadline ends with 'deadline' at once; a request id already in
flight is ignored, as at-least-once delivery may hand it over twice). The task runs under
an asyncio timeout at the request's deadline. Output goes out through `_emit`, the
terminal delta carrying the usage; `abort` ends the request at once (terminal 'abort')
and cancels its task. A subclass either coalesces the deltas of one pass of the loop into
one batch (`coalesce`) or sends each as a batch of its own. `_die` ends every in-flight
and pending request with a retryable 'error', turns `health()` False and ends
`deltas()`; `shutdown` does the same with 'abort'. Calls from the loop's own thread run
at once, so an abort made while reading a delta stops the request before its next chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from sluice.engine.backends.base import (
    EngineDeadError,
    EngineDelta,
    EngineLogprob,
    EngineRequest,
    FinishReason,
    call_on_loop,
    check_request,
    queued_batches,
    terminal_delta,
)

__all__ = ["LiveRequest", "PerRequestBackend"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LiveRequest:
    """A request in flight: its task and the usage counted so far."""

    request: EngineRequest
    task: asyncio.Task[None] | None = None
    num_output: int = 0
    num_cached: int = 0
    done: bool = False


LiveT = TypeVar("LiveT", bound=LiveRequest)


class PerRequestBackend(ABC, Generic[LiveT]):
    """One asyncio task per request behind `EngineBackend`; see the module docstring."""

    name: ClassVar[str]  # in logs and task names: "trtllm", "upstream"
    coalesce: ClassVar[bool]  # one batch per pass of the loop, else one per delta
    max_model_len: int
    vocab_size: int | None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._queue: asyncio.Queue[list[EngineDelta] | None] | None = None
        self._pending: dict[str, EngineRequest] = {}  # submitted, not yet on the loop
        self._live: dict[str, LiveT] = {}
        self._batch: dict[str, EngineDelta] = {}  # deltas not yet put on the queue
        self._flush_scheduled = False
        self._closed = True  # not started, dead, or shut down
        self._stopping = False
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._num_generated_tokens = 0

    # -- what a subclass provides ----------------------------------------------------
    @abstractmethod
    def _new_live(self, request: EngineRequest) -> LiveT: ...

    @abstractmethod
    async def _generate(self, live: LiveT) -> None:
        """Run `live` to its terminal delta (the deadline is watched around it)."""

    @abstractmethod
    def _failed(self, live: LiveT, exc: Exception) -> None:
        """`_generate` raised `exc`: end the request, or `_die`."""

    def _prepare(self) -> None:
        """Before the first start (off the loop; may block)."""

    def _on_loop_start(self) -> None:
        """On the loop, once it serves: start what runs beside the requests."""

    def _on_end(self) -> None:
        """On the loop, as the engine stops: stop what `_on_loop_start` started."""

    def _release(self) -> None:
        """At `shutdown`, after the requests ended."""

    def _check_supported(self, request: EngineRequest) -> None:
        """Raise RequestRejectedError for what this engine cannot do."""

    def _can_serve(self) -> bool:
        return True

    # -- lifecycle -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._loop is not None:
            raise RuntimeError("engine already started")
        self._prepare()
        self._open(loop or asyncio.get_running_loop())

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._queue = loop, asyncio.Queue()
        self._done.clear()
        with self._lock:
            self._closed, self._error = False, None
        call_on_loop(loop, self._begin)

    def _begin(self) -> None:
        self._loop_thread = threading.get_ident()
        self._on_loop_start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            running = not self._closed
        loop = self._loop
        if running and loop is not None:
            if threading.get_ident() == self._loop_thread:
                self._end("abort", None)
            else:
                try:
                    loop.call_soon_threadsafe(self._end, "abort", None)
                except RuntimeError:  # the loop is closed: nobody reads deltas any more
                    self._end("abort", None)
                if not self._done.wait(timeout_s):
                    logger.warning("%s backend did not stop within %.1fs", self.name, timeout_s)
        self._release()

    def health(self) -> bool:
        return not self._closed and not self._stopping and self._error is None and self._can_serve()

    @property
    def error(self) -> BaseException | None:
        """What killed the engine, if it died."""
        return self._error

    # -- requests in -----------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        check_request(request, self.max_model_len, self.vocab_size)
        self._check_supported(request)
        with self._lock:
            if self._closed or self._stopping:
                raise EngineDeadError("engine is not running") from self._error
            self._pending.setdefault(request.request_id, request)
        self._on_loop(self._add, request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._closed or self._stopping:
                return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to abort
            self._on_loop(self._abort, request_id)

    def _on_loop(self, method: Callable[[Any], None], arg: Any) -> None:
        """`method(arg)` on the loop, in call order, from any thread."""
        assert self._loop is not None
        if threading.get_ident() == self._loop_thread:
            method(arg)
        else:
            self._loop.call_soon_threadsafe(method, arg)

    def _add(self, request: EngineRequest) -> None:
        with self._lock:
            if self._pending.get(request.request_id) is request:
                del self._pending[request.request_id]
            if self._closed:
                return  # `_end` answered it from `_pending`
        if request.request_id in self._live:
            logger.warning("request_id=%s submitted twice; ignored", request.request_id)
            return
        live = self._new_live(request)
        self._live[request.request_id] = live
        if request.deadline is not None and request.deadline <= time.monotonic():
            self._finish(live, "deadline")
            return
        assert self._loop is not None
        name = f"{self.name}-{request.request_id}"
        live.task = self._loop.create_task(self._serve(live), name=name)

    def _abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            self._finish(live, "abort")

    # -- one request -----------------------------------------------------------------
    async def _serve(self, live: LiveT) -> None:
        try:
            async with asyncio.timeout_at(self._loop_deadline(live.request)):
                await self._generate(live)
        except TimeoutError:
            self._finish(live, "deadline")
        except Exception as exc:
            self._failed(live, exc)

    def _loop_deadline(self, request: EngineRequest) -> float | None:
        if request.deadline is None:
            return None
        assert self._loop is not None
        return self._loop.time() + (request.deadline - time.monotonic())

    # -- deltas out ------------------------------------------------------------------
    def deltas(self) -> AsyncIterator[list[EngineDelta]]:
        return queued_batches(self._queue)

    def _emit(
        self,
        live: LiveT,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None = None,
        *,
        stop_reason: str | int | None = None,
        error: str | None = None,
        retryable: bool = False,
        logprobs: list[EngineLogprob] | None = None,
    ) -> None:
        """Output of `live`; the terminal delta (`reason` set) carries the usage, and
        cancels the request's task unless that task is the one ending it."""
        if live.done:
            return
        request_id = live.request.request_id
        live.num_output += len(token_ids)
        self._num_generated_tokens += len(token_ids)
        delta = self._batch.get(request_id)
        if delta is None:
            delta = self._batch[request_id] = EngineDelta(request_id)
        delta.token_ids.extend(token_ids)
        delta.text += text
        if logprobs is not None:
            delta.logprobs = (delta.logprobs or []) + logprobs
        if reason is not None:
            live.done = True
            self._live.pop(request_id, None)
            delta.finish_reason, delta.stop_reason = reason, stop_reason
            delta.error, delta.retryable = error, retryable
            delta.num_prompt_tokens = len(live.request.prompt_token_ids)
            delta.num_cached_tokens = live.num_cached
            delta.num_output_tokens = live.num_output
        if not self.coalesce:
            self._flush()
        elif not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        if reason is not None and live.task is not None and live.task is not asyncio.current_task():
            live.task.cancel()

    def _finish(
        self,
        live: LiveT,
        reason: FinishReason,
        error: str | None = None,
        retryable: bool = False,
        stop_reason: str | int | None = None,
    ) -> None:
        """The terminal delta of `live` (once), its task cancelled."""
        self._emit(live, [], "", reason, stop_reason=stop_reason, error=error, retryable=retryable)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._batch and self._queue is not None:
            batch, self._batch = list(self._batch.values()), {}
            self._queue.put_nowait(batch)

    # -- the engine's end ------------------------------------------------------------
    def _die(self, exc: BaseException) -> None:
        if self._closed:
            return
        if self._error is None:
            logger.error("%s backend died: %s: %s", self.name, type(exc).__name__, exc)
            self._error = exc
        self._end("error", f"engine failed: {type(exc).__name__}: {exc}")

    def _end(self, reason: FinishReason, error: str | None) -> None:
        """End every in-flight and pending request with `reason` (retryable when the
        engine failed under them: `error` set), then `deltas()`; once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
        died = error is not None
        for live in list(self._live.values()):
            self._finish(live, reason, error, died)
        for request in pending:
            if request.request_id not in self._batch:
                self._batch[request.request_id] = terminal_delta(request, reason, error, died)
        self._on_end()
        self._flush()
        if self._queue is not None:
            self._queue.put_nowait(None)
        self._done.set()
        logger.info("%s backend stopped: %s", self.name, error or "shut down")
