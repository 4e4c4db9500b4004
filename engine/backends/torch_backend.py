"""`TorchEngineBackend`: Sluice's own engine behind `EngineBackend`, its loop in a thread.

Where the pipeline meets the engine: the engine worker (or embedded mode) calls
`submit`/`abort` from asyncio; a daemon thread drains those commands at the top of
each step, runs `EngineCore.step()`, and hands each step's deltas to the asyncio loop
with one `call_soon_threadsafe` (one batch per step). The thread sleeps on a condition
when there is no work and never waits on Python I/O; torch releases the GIL inside its
ops, so the asyncio side stays responsive.

If the loop raises, the engine is dead: every in-flight request gets a terminal delta
with finish_reason 'error', `health()` turns False, `submit` raises EngineDeadError and
`deltas()` ends. At `shutdown`, in-flight requests end with 'abort'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from sluice.engine.backends.base import (
    DeltaChannel,
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    EngineStats,
    FinishReason,
    check_request,
    terminal_delta,
)
from sluice.engine.config import EngineConfig
from sluice.engine.cpus import pin_this_thread
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.options import EngineOptions

logger = logging.getLogger(__name__)

_Command = tuple[str, Any]  # ("add", EngineRequest) | ("abort", request_id)


class TorchEngineBackend:
    """Runs an `EngineCore` in a daemon thread; see the module docstring for the contract.

    Construct with `from_model(...)` for a real model, or around any `EngineCore` (tests
    use a fake runner). `options` (default `EngineOptions()`): the engine thread's nice
    value and cores, applied as it starts, and the runner's options (`from_model`); their
    process-wide part is the composition root's (`engine.options.apply_process_options`).
    `start()` must be called from the asyncio loop that consumes
    `deltas()`, or be given that loop; or be given a `sink` that takes each step's
    deltas on the engine thread instead (`engine.backends.process_backend` sends them to
    another process), None last.
    """

    def __init__(
        self, core: EngineCore, *, tokenizer: Any = None, options: EngineOptions | None = None
    ) -> None:
        self.core = core
        self.options = options or EngineOptions()
        self.config = core.config
        self.vocab_size = core.vocab_size  # token ids `submit` accepts: [0, vocab_size)
        self.tokenizer = tokenizer  # for callers that need to encode/decode (may be None)
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._channel = DeltaChannel()
        self._sink: Callable[[list[EngineDelta] | None], None] = self._channel.post
        self._error: BaseException | None = None
        self._closed = False
        self._stats = core.stats()
        # After a step that gave a request its first token, the engine thread sleeps this
        # long before the next step, so the thread that delivers the step (the asyncio
        # loop, woken by `_publish`) gets a core and the GIL now rather than after the
        # next step; only steps that give first tokens pay it.
        self.first_token_yield_s = 0.0002

    @classmethod
    def from_model(
        cls,
        model: str | Path = "tiny-llama",
        *,
        config: EngineConfig | None = None,
        data_dir: str | Path | None = None,
        quantization: str | None = None,
        config_overrides: dict[str, Any] | None = None,
        options: EngineOptions | None = None,
    ) -> TorchEngineBackend:
        """Load a Hugging Face directory or the `tiny-llama` preset and build the engine."""
        from sluice.engine.loader import load_model
        from sluice.engine.runner.model_runner import ModelRunner
        from sluice.engine.structured import GrammarCompiler

        config = config or EngineConfig()
        loaded = load_model(
            model,
            data_dir=data_dir,
            dtype=config.dtype,
            device=config.device,
            quantization=quantization,
            config_overrides=config_overrides,
        )
        grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)
        runner = ModelRunner(loaded.model, config, options, grammars)
        core = EngineCore(
            config,
            runner,
            num_kv_blocks=runner.num_kv_blocks,
            eos_token_ids=loaded.eos_token_ids,
            detokenizers=tokenizer_detokenizers(loaded.tokenizer),
        )
        logger.info(
            "engine loaded model=%s kv_blocks=%s block_size=%s device=%s dtype=%s compute=%s",
            loaded.path.name,
            runner.num_kv_blocks,
            config.block_size,
            config.device,
            config.dtype,
            str(runner.dtype).removeprefix("torch."),
        )
        return cls(core, tokenizer=loaded.tokenizer, options=options)

    def attach(self, channel: Any) -> None:
        """Post each step to `channel` (`open(loop)`, `post(batch)`) instead of this
        backend's own `deltas()` stream (`engine.backends.replicated`)."""
        self._channel, self._sink = channel, channel.post

    # -- lifecycle -------------------------------------------------------------------
    def start(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: Callable[[list[EngineDelta] | None], None] | None = None,
    ) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        if sink is None:
            self._channel.open(loop)
        else:
            self._sink = sink
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.1fs", timeout_s)

    def health(self) -> bool:
        thread = self._thread
        return (
            thread is not None and thread.is_alive() and self._error is None and not self._stopping
        )

    @property
    def error(self) -> BaseException | None:
        """What killed the engine loop, if it died."""
        return self._error

    # -- requests in -----------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        check_request(request, self.config.max_model_len, self.vocab_size)
        with self._cond:
            if self._closed or self._stopping:
                raise EngineDeadError("engine is not running") from self._error
            self._inbox.append(("add", request))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._closed:
                return
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    # -- deltas out ------------------------------------------------------------------
    def deltas(self) -> AsyncIterator[list[EngineDelta]]:
        return self._channel.stream()

    def stats(self) -> EngineStats:
        stats = self._stats
        num_pending = len(self._inbox)
        if num_pending == stats.num_pending:
            return stats
        return dataclasses.replace(stats, num_pending=num_pending)

    def _publish(self, batch: list[EngineDelta] | None) -> None:
        self._sink(batch)

    # -- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        core, options = self.core, self.options
        # the engine thread's own cores and priority (Linux, where a thread has its own);
        # the nice value only when torch computes on this thread alone: torch's helper
        # threads keep the priority of the thread that created them, and a niced thread
        # would leave them waiting
        if options.cpus:
            pin_this_thread(options.cpus)
        if options.thread_nice is not None:
            _renice_this_thread(options.thread_nice)
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping and not core.has_unfinished():
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._inbox = self._inbox, []
                batch = self._apply(commands)
                first_tokens = core.num_first_tokens
                batch.extend(core.step())
                self._stats = core.stats()
                if batch:
                    self._publish(batch)
                if core.num_first_tokens != first_tokens and self.first_token_yield_s:
                    time.sleep(self.first_token_yield_s)
        except BaseException as exc:
            logger.exception("engine loop died")
            self._error = exc
            self._finish("error", f"engine failed: {type(exc).__name__}: {exc}")
        else:
            self._finish("abort", "engine shut down")

    def _apply(self, commands: list[_Command]) -> list[EngineDelta]:
        """Add and abort in arrival order; a rejected add ends at once with 'error'."""
        core = self.core
        rejected: list[EngineDelta] = []
        for kind, payload in commands:
            if kind == "abort":
                core.abort_request(payload)
            elif core.has_request(payload.request_id):
                # at-least-once delivery can hand us a request twice: keep the first
                logger.warning("request_id=%s submitted twice; ignored", payload.request_id)
            else:
                try:
                    core.add_request(payload)
                except Exception as exc:
                    logger.warning("request_id=%s rejected: %s", payload.request_id, exc)
                    rejected.append(terminal_delta(payload, "error", str(exc)))
        return rejected

    def _finish(self, finish_reason: FinishReason, message: str) -> None:
        """End every in-flight and pending request, then end `deltas()`."""
        with self._cond:
            pending, self._inbox, self._closed = self._inbox, [], True
        error = message if finish_reason == "error" else None
        died = error is not None  # the loop died under these requests: they may run again
        deltas = [terminal_delta(p, finish_reason, error, died) for k, p in pending if k == "add"]
        try:
            deltas.extend(self.core.abort_all(finish_reason, error))
        except Exception:  # the core itself is broken: still end every request
            logger.exception("could not abort requests cleanly")
            deltas.extend(
                EngineDelta(request_id, finish_reason=finish_reason, error=error)
                for request_id in self.core.request_ids()
            )
        for delta in deltas:
            delta.retryable = died
        if deltas:
            self._publish(deltas)
        self._publish(None)
        logger.info("engine loop stopped: %s", message)


def apply_process_options(options: EngineOptions) -> None:
    """The process-wide part of `options`, for the process the engine runs in: torch's
    intra-op threads and the native kernels' configuration. Only a composition root calls
    it (`sluice.wiring`, the engine process's entry point, a benchmark), before the model
    loads."""
    import torch

    from sluice.engine import kernels

    if options.torch_threads is not None:
        torch.set_num_threads(options.torch_threads)
    kernels.configure(options)


def _renice_this_thread(nice: int) -> None:
    """Give the calling thread `nice` (Linux: a thread id is a process id to setpriority)
    when torch has no helper threads; elsewhere, or where it is refused, the thread keeps
    its priority."""
    import torch

    if not hasattr(os, "setpriority") or torch.get_num_threads() != 1:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        logger.info("engine thread keeps its priority: setpriority(%s) failed: %s", nice, exc)
