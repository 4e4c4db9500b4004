"""The engine worker: lane topics in, engine in the middle, token deltas and usage out.

Sits between Kafka and the engine (DESIGN.md §1): a consumer group over the three lane
topics pulls micro-batches into a local admission buffer (priority-weighted lanes,
tenant-fair within, `consumers.admission`), which feeds the engine as capacity allows.
Each engine step becomes one `TokenDeltaBatch` per reply target, plus one `UsageRecord`
and `TelemetryRecord` per finished attempt (`consumers.engine_outputs`).

Threads: `run()` owns an asyncio loop (engine deltas, admission, publishing, progress)
and one poll thread that alone touches the bus consumers (`consumers.engine_poller`).
All worker state lives on the loop thread; the poll thread only polls, commits, pauses.

Invariants (DESIGN.md §5): a partition is committed only up to its lowest request that
is not terminal with its terminal delta and usage publishes confirmed (buffered
requests hold it back too); a full engine pauses the lanes while polling goes on; a
request resumed after a failover continues from the progress store with a higher
attempt; cancels and deadlines end a request wherever it is, with exactly one terminal
delta and one usage record per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bus.base import EventBus, TopicPartition
from bus.topics import Lane, request_topic
from consumers.engine_flow import RequestFlow
from consumers.engine_poller import LanePoller, PollResult
from consumers.progress import ProgressStore
from engine.backends.base import (
    EngineBackend,
    EngineDeadError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineWorkerConfig:
    """Tuning of one engine worker; `sluice.settings.EngineWorkerSettings` builds it.

    Backpressure: a partition is paused while the engine is full (waiting + pending
    requests at `max_engine_waiting`, KV usage at `max_kv_usage`, or `max_in_engine`
    requests submitted) and `full_engine_lookahead` of its requests are buffered, or
    whenever it has `max_buffered_per_partition` buffered. Pausing per partition (not
    per lane) keeps a tenant's backlog on one partition from blocking the others; the
    lookahead lets the admission buffer see each tenant's next requests.
    """

    group_id: str = "engine"
    lanes: tuple[Lane, ...] = (Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH)
    lane_weights: Mapping[Lane, int] = field(
        default_factory=lambda: {Lane.INTERACTIVE: 16, Lane.STANDARD: 4, Lane.BATCH: 1}
    )
    tenant_quantum_tokens: int = 256
    poll_timeout_s: float = 0.05
    max_records: int = 64
    # At most one periodic commit per interval; it does not wait for the broker (a
    # waiting one held up the poll thread p50 1 ms, up to 9 ms). Drain and revocation
    # commit the latest watermarks and wait. A later commit only widens what a failover
    # redoes.
    commit_interval_s: float = 0.2
    max_buffered_per_partition: int = 32
    # With 1, a light tenant's next request was fetched only after its last buffered one
    # entered the engine: the engine counts as full whenever 8 requests wait for their
    # prefill, all through a ramp-up, and the heavy tenant took the slots meanwhile
    # (fairness run: B had 25 of 64 running when the first requests finished).
    full_engine_lookahead: int = 8
    max_engine_waiting: int = 8
    max_kv_usage: float = 0.9
    max_in_engine: int = 128
    cancel_ttl_s: float = 600.0
    max_cancelled: int = 100_000
    drain_timeout_s: float = 30.0
    # The engine thread shares the GIL with the Kafka client's threads; at CPython's
    # default 5 ms switch interval each engine step waited for the GIL behind them
    # (measured on tiny-llama: submit -> first delta 8.2 ms in the worker vs 3.5 ms
    # direct). None leaves the interpreter's setting alone.
    gil_switch_interval_s: float | None = 0.0005
    # The engine thread's nice value (`TorchEngineBackend.thread_nice`, applied when the
    # engine has one torch thread): a busy engine then yields its core whenever the
    # threads that move requests and tokens (this loop, the Kafka clients, a broker or
    # gateway on the same machine) can run, and takes every cycle they leave. `bench
    # serving`'s priority run on the 2-core VM, three alternating pairs: interactive TTFT
    # beside a batch backlog p50 15.6, 13.9, 16.2 ms and p99 25.3, 20.9, 31.4 ms at 10
    # against p50 18.0, 14.9, 18.4 and p99 30.3, 28.2, 31.8 at 0; batch tokens/s in the
    # window 1,394, 1,573, 1,238 against 1,253, 1,556, 1,229. None leaves it alone.
    engine_thread_nice: int | None = 10
    tick_s: float = 0.05
    # Mid-stream deltas of one reply target go out at most this often (first tokens and
    # terminal deltas at once): see `consumers.engine_publisher`. 0 sends every step.
    reply_interval_s: float = 0.01
    control_group_prefix: str = "engine-control"
    # The broker may hold the control consumer's empty fetches this long: cancels reach
    # the engine up to this much later than at the bus default (5 ms), and the broker
    # answers 10x fewer fetches. On the 2-core VM, Tansu spent 0.13 of a core on this
    # consumer's empty fetches at 5 ms, 0.03 at 50 (it shares the cores with the engine
    # worker's loop and the gateway, whose hops carry every token). None: bus default.
    control_max_wait_ms: int | None = 50


@dataclass(slots=True)
class WorkerStats:
    """A snapshot for readiness probes and metrics."""

    ready: bool = False
    healthy: bool = True
    draining: bool = False
    assigned: int = 0
    paused: int = 0
    buffered: int = 0
    in_engine: int = 0
    held: int = 0  # requests held (buffered, in the engine, or publishing)
    received: int = 0
    finished: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    fenced: int = 0
    commits: int = 0


class EngineWorker:
    """One engine worker; see the module docstring. `run()` blocks until stopped."""

    def __init__(
        self,
        bus: EventBus,
        backend: EngineBackend,
        config: EngineWorkerConfig,
        progress: ProgressStore,
        worker_id: str,
    ) -> None:
        self.bus = bus
        self.backend = backend
        self.config = config
        self.progress = progress
        self.worker_id = worker_id
        self.stats = WorkerStats()
        self._stop = threading.Event()
        self._abandon = False
        self._polling = True
        self._done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._kafka = ThreadPoolExecutor(1, thread_name_prefix=f"sluice-poll-{worker_id}")
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"sluice-progress-{worker_id}")
        self._poller = LanePoller(
            bus,
            config.group_id,
            [request_topic(lane) for lane in config.lanes],
            f"{config.control_group_prefix}-{worker_id}-{uuid.uuid4().hex[:8]}",
            self._on_assignment_threadsafe,
            lambda: self._flow.commit_snapshot,
            config.control_max_wait_ms,
        )
        self._flow = RequestFlow(
            bus, backend, config, progress, self._io, worker_id, self.stats, self._engine_died
        )
        self._drain_timeout_s = config.drain_timeout_s

    # -- lifecycle (any thread) -----------------------------------------------------------
    def run(self) -> None:
        """Serve until `stop()`/`drain()`; raises EngineDeadError if the engine died."""
        if self.config.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop pulling, finish in-flight work within the timeout, commit, return."""
        if drain_timeout_s is not None:
            self._drain_timeout_s = drain_timeout_s
        self._stop.set()
        self._wake_threadsafe()

    def drain(self, timeout_s: float | None = None) -> bool:
        """`stop()` and wait for `run()` to return; True when it did."""
        self.stop(timeout_s)
        wait = (timeout_s if timeout_s is not None else self._drain_timeout_s) + 10.0
        return self._done.wait(wait)

    def abandon(self) -> None:
        """Leave at once as a kill -9 would: no drain, no commit, no terminal deltas.

        For fault-injection tests; the group redelivers everything uncommitted.
        """
        self._abandon = True
        self._stop.set()
        self._wake_threadsafe()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the worker holds partitions (or `timeout_s` passes)."""
        pause = threading.Event()
        for _ in range(max(1, int(timeout_s / 0.02))):
            if self.stats.ready:
                return True
            pause.wait(0.02)
        return self.stats.ready

    def health(self) -> bool:
        return self.stats.healthy and not self._done.is_set()

    def _wake_threadsafe(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(wake.set)

    # -- the loop ---------------------------------------------------------------------
    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if hasattr(self.backend, "thread_nice"):
            self.backend.thread_nice = self.config.engine_thread_nice
        self.backend.start()
        await self._on_kafka(self._poller.open)
        self._flow.publisher.bind(self._loop)
        deltas = asyncio.create_task(self._delta_loop(), name="engine-deltas")
        ticker = asyncio.create_task(self._tick_loop(), name="engine-ticks")
        poll = asyncio.create_task(self._poll_loop(), name="engine-poll")
        try:
            while not self._stop.is_set() and not poll.done():
                await asyncio.sleep(0.02)
            if not self._abandon:
                await self._drain()  # the poll loop goes on, every lane paused
            self._polling = False
            await poll
            if not self._abandon:
                offsets = self._flow.offsets
                committed = await self._on_kafka(self._poller.commit, offsets.to_commit())
                offsets.committed(committed)
        finally:
            self._polling = False
            ticker.cancel()
            if self._abandon:
                deltas.cancel()
                self._flow.publisher.close()
            await self._shutdown(deltas, poll)
        if not self.stats.healthy:
            raise EngineDeadError("the engine died; this worker stopped")

    async def _on_kafka(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._kafka, fn, *args)

    async def _poll_loop(self) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        next_commit = 0.0
        while self._polling and not self._abandon:
            commits = {}
            if loop.time() >= next_commit:
                commits = self._flow.offsets.to_commit()
                if commits:
                    next_commit = loop.time() + config.commit_interval_s
            result: PollResult = await self._on_kafka(
                self._poller.cycle,
                commits,
                self._flow.pause_partitions(self._flow.engine_full(0)),
                config.poll_timeout_s,
                config.max_records,
            )
            if not self._abandon:
                self._after_poll(result)

    def _after_poll(self, result: PollResult) -> None:
        flow = self._flow
        flow.offsets.committed(result.committed)
        self.stats.commits += bool(result.committed)
        self.stats.ready = bool(result.assignment) or self.stats.ready
        self.stats.assigned, self.stats.paused = len(result.assignment), len(result.paused)
        for record in result.controls:
            flow.on_control(record)
        for record in result.records:
            flow.on_record(record)
        flow.admit()
        flow.refresh_stats()

    def _engine_died(self) -> None:
        self.stats.healthy = False
        self._stop.set()

    async def _delta_loop(self) -> None:
        try:
            async for batch in self.backend.deltas():
                self._flow.on_step(batch)
        except Exception:
            logger.exception("worker=%s engine delta stream failed", self.worker_id)
        if not self._stop.is_set():
            logger.error("worker=%s engine stopped; stopping without commit", self.worker_id)
            self.stats.healthy = False
            self._stop.set()

    async def _tick_loop(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_s):  # wait_for can eat a cancel
                    await wake.wait()
            wake.clear()
            self._flow.stopping = self._stop.is_set()
            self._flow.tick()
            if not self.backend.health() and not self._stop.is_set():
                logger.error("worker=%s engine unhealthy; stopping", self.worker_id)
                self.stats.healthy = False
                self._stop.set()

    async def _drain(self) -> None:
        """Finish what the engine holds within the timeout, then abort the rest.

        Requests still in the admission buffer never started: they stay uncommitted and
        the group hands them to another member.
        """
        self.stats.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        flow = self._flow
        flow.stopping = True
        while flow.num_in_engine and loop.time() < deadline and self.stats.healthy:
            await asyncio.sleep(0.02)
        for request_id in flow.running_ids():
            logger.info("request_id=%s aborted by drain", request_id)
            self.backend.abort(request_id)
        while flow.num_in_engine and loop.time() < deadline + 5.0 and self.stats.healthy:
            await asyncio.sleep(0.02)
        await self._flow.publisher.flush(timeout_s=10.0)
        logger.info(
            "worker=%s drained; %s requests left for the group", self.worker_id, flow.num_held
        )

    async def _shutdown(self, deltas: asyncio.Task[None], poll: asyncio.Task[None]) -> None:
        self.backend.shutdown(5.0)
        for task in (deltas, poll):
            if not task.done():
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(task, 5.0)
        if not self._abandon:  # terminal deltas of a shut-down engine still go out
            await self._flow.publisher.flush(timeout_s=5.0)
        self._flow.cancel_tasks()
        self._flow.publisher.close()
        await self._on_kafka(self._poller.close)
        self._kafka.shutdown(wait=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._flow.refresh_stats()

    def _on_assignment_threadsafe(self, partitions: set[TopicPartition]) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._flow.on_assignment, partitions)
