"""The engine side of `sluice bulk`: lines through the embedded stack, a window in flight.

`sluice serve`'s embedded stack without HTTP (docs/architecture.md §2): the memory bus,
the engine worker with its engine process, and a `GatewayService` on the bus. Each line
goes through the service as a batch line of this run: `consumers/batches/lines.py`
builds its requests and formats its result, as for a batch. `Pump` keeps a bounded
window of lines in flight, enough to keep the engine's batch full, and hands results to
the ordered writer (`sluice/bulk_files.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from sluice import wiring
from sluice.api.app import request_limits
from sluice.api.auth import Principal
from sluice.api.deps import Gateway
from sluice.api.errors import APIError
from sluice.api.served import ModelCatalog, ServedModel
from sluice.api.service import GatewayService
from sluice.bulk_files import InputLine, OrderedWriter, Summary
from sluice.bus.memory import MemoryEventBus
from sluice.consumers.batches.lines import (
    BATCH_REPLY_TARGET,
    answer_body,
    line_request_id,
    output_line,
    prepare_line,
    refused_line,
    run_error,
)
from sluice.settings import EngineWorkerSettings, GatewaySettings

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # how long Ctrl-C lets the lines in flight finish before abandoning them
DRAIN_S = 10.0  # the engine worker's drain at the end (abandoned lines are cancelled)
BUFFER_PER_WINDOW = 4  # results waiting for an earlier line, per line of the window


# -- the pump ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LineResult:
    """A line's output (or error) line, and what the engine generated for it."""

    text: str
    ok: bool
    output_tokens: int = 0


RunLine = Callable[[InputLine], Awaitable[LineResult]]


class Pump:
    """Runs lines through `run_line`, at most `window` in flight, results to the writer.

    Submission also waits while `max_buffered` results wait for an earlier line: one
    long line holds the file's order, and memory must not grow with everything behind it.
    """

    def __init__(
        self,
        run_line: RunLine,
        writer: OrderedWriter,
        summary: Summary,
        *,
        window: int,
        max_buffered: int,
        on_progress: Callable[[Summary], None] | None = None,
    ) -> None:
        self.run_line = run_line
        self.writer = writer
        self.summary = summary
        self.window = window
        self.max_buffered = max_buffered
        self.on_progress = on_progress
        self.abandoned = 0  # lines cut off by a stop, left to a resume
        self._crash: BaseException | None = None

    async def run(
        self,
        lines: Sequence[InputLine],
        stop: asyncio.Event,
        abandon: asyncio.Event,
        grace_s: float,
    ) -> bool:
        """True when every line was written. On `stop`: submit nothing more, give the
        lines in flight `grace_s` (or until `abandon`), cancel the rest, write what is
        done (out of order) and return False."""
        stopped = asyncio.create_task(stop.wait())
        in_flight: set[asyncio.Task[None]] = set()
        try:
            for seq, line in enumerate(lines):
                while not stop.is_set() and (
                    len(in_flight) >= self.window or self.writer.buffered >= self.max_buffered
                ):
                    await asyncio.wait({*in_flight, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():
                    break
                task = asyncio.create_task(self._one(seq, line, stop))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            while in_flight and not stop.is_set():
                await asyncio.wait({*in_flight, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if in_flight:
                await self._wind_down(in_flight, abandon, grace_s)
        finally:
            stopped.cancel()
        if self._crash is not None:
            self.writer.flush_all()
            raise self._crash
        complete = self.writer.next_seq == len(lines)
        if not complete:
            self.writer.flush_all()
        return complete

    async def _one(self, seq: int, line: InputLine, stop: asyncio.Event) -> None:
        try:
            result = await self.run_line(line)
        except asyncio.CancelledError:
            self.abandoned += 1
            raise
        except Exception as exc:  # a bug, not a line's fault: stop, keep what is done
            logger.exception("line %d failed unexpectedly; stopping", line.number)
            self._crash = self._crash or exc
            stop.set()
            return
        self.summary.output_tokens += result.output_tokens
        if result.ok:
            self.summary.ok += 1
        else:
            self.summary.failed += 1
        self.writer.put(seq, result.text, result.ok)
        if self.on_progress is not None:
            self.on_progress(self.summary)

    async def _wind_down(
        self, in_flight: set[asyncio.Task[None]], abandon: asyncio.Event, grace_s: float
    ) -> None:
        abandoned = asyncio.create_task(abandon.wait())
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            while in_flight and not abandon.is_set() and loop.time() < deadline:
                await asyncio.wait(
                    {*in_flight, abandoned},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            abandoned.cancel()
        pending = list(in_flight)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


# -- one line, in-process ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LineRunner:
    """Runs one input line through the gateway's service, as a batch line of this run."""

    gw: Gateway
    endpoint: str
    model: ServedModel
    batch_id: str  # this run's: request ids are `req_<hex>_<line>`, as a batch's
    window_s: int  # each line's deadline, from its submission

    async def __call__(self, line: InputLine) -> LineResult:
        if line.error is not None or line.body is None or line.custom_id is None:
            return LineResult(line.error_line(), ok=False)
        index = line.number - 1
        request_id = line_request_id(self.batch_id, index)
        try:
            prepared = await asyncio.to_thread(  # tokenizing: off the loop, as the routes do
                prepare_line,
                self.gw,
                self.endpoint,
                line.body,
                Principal(tenant_id="default"),  # embedded mode's tenant
                batch_id=self.batch_id,
                line=index,
                custom_id=line.custom_id,
                deadline_ms=int((time.time() + self.window_s) * 1000),
            )
            call = prepared.call
            generation = await self.gw.service.submit(call.requests, call.deadline_ms)
        except APIError as exc:  # a body the endpoint refuses: the endpoint's own error
            return LineResult(refused_line(line.custom_id, request_id, exc), ok=False)
        try:
            results = await generation.collect()
        except asyncio.CancelledError:
            generation.abandon("bulk run interrupted")
            raise
        tokens = generation.num_completion_tokens
        error = run_error(results)
        if error is not None:
            return LineResult(refused_line(line.custom_id, request_id, error), False, tokens)
        body = answer_body(
            self.endpoint,
            line.body,
            self.model,
            call.call_id,
            results,
            call.num_prompt_tokens,
            generation.num_cached_tokens,
            generation.created,
        )
        return LineResult(output_line(line.custom_id, request_id, 200, body), True, tokens)


# -- the embedded stack ----------------------------------------------------------------------
@contextlib.contextmanager
def embedded_engine(settings: EngineWorkerSettings, bus: MemoryEventBus) -> Iterator[None]:
    """The engine worker (and its engine process) on `bus`, as `sluice serve` runs it."""
    options = wiring.engine_options(settings)
    wiring.apply_process_effects(settings, options)
    backend = wiring.build_backend(settings, options)
    worker = wiring.build_worker(settings, bus, backend)
    thread = threading.Thread(target=worker.run, name="sluice-engine-worker", daemon=True)
    thread.start()
    # lines go out only once the worker's group has joined: before that the in-memory
    # bus keeps a partition's newest records only, and a large window could lose some
    probe = wiring.WorkerProbe([worker])
    while not probe.ready():
        if not thread.is_alive():
            raise RuntimeError("the engine worker stopped before it was ready")
        time.sleep(0.05)
    try:
        yield
    finally:
        worker.drain(DRAIN_S)


async def run_lines(
    bus: MemoryEventBus,
    settings: GatewaySettings,
    served: ServedModel,
    endpoint: str,
    todo: list[InputLine],
    writer: OrderedWriter,
    summary: Summary,
    *,
    window: int,
    on_progress: Callable[[Summary], None] | None = None,
) -> bool:
    """The lines through a `GatewayService` on `bus`, `window` of them in flight; True
    when every one was written.

    SIGINT / SIGTERM stop submitting; a second one abandons the lines in flight at once.
    """
    # the batch lines' reply target, so the engine's answers come to this service
    service = GatewayService(bus, gateway_id=BATCH_REPLY_TARGET)
    await service.start()
    gw = Gateway(
        service=service,
        models=ModelCatalog([served]),
        limits=request_limits(settings),
        sse_ping_s=15.0,
    )
    runner = LineRunner(gw, endpoint, served, f"batch_{uuid.uuid4().hex}", settings.batch_window_s)
    stop, abandon = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def _on_signal() -> None:
        (abandon if stop.is_set() else stop).set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _on_signal)
    pump = Pump(
        runner,
        writer,
        summary,
        window=window,
        max_buffered=BUFFER_PER_WINDOW * window,
        on_progress=on_progress,
    )
    summary.started_at = time.monotonic()  # tokens/s counts from the first line
    try:
        return await pump.run(todo, stop, abandon, GRACE_S)
    finally:
        summary.ended_at = time.monotonic()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await service.stop()


def default_window(settings: EngineWorkerSettings) -> int:
    """Twice the engine's sequences: a full batch running and as many queued behind it,
    so a finished sequence's slot is refilled at once."""
    return 2 * settings.max_num_seqs
