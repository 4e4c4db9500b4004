"""The engine worker: lane topics in, engine in the middle, token deltas and usage out.

Sits between Kafka and the engine (docs/architecture.md §1, §10): a consumer group over the
three lane topics pulls micro-batches into a local fair queue (priority-weighted lanes,
tenant-fair within, `consumers.fair_queue`), which feeds the engine as capacity allows.
Each engine step becomes one `TokenDeltaBatch` per reply target, plus one `UsageRecord`
and `TelemetryRecord` per finished attempt (`consumers.engine_outputs`).

Threads: `run()` owns an asyncio loop (engine deltas, admission, publishing, progress)
and one poll thread that alone touches the bus consumers (`consumers.engine_poller`).
All worker state lives on the loop thread; the poll thread only polls, commits, pauses.

Invariants (docs/architecture.md §5): a partition is committed only up to its lowest request that
is not terminal with its terminal delta and usage publishes confirmed (buffered
requests hold it back too); a full engine pauses the lanes while polling goes on; a
request resumed after a failover continues from the progress store with a higher
attempt; cancels and deadlines end a request wherever it is, with exactly one terminal
delta and one usage record per attempt.

A dead engine that can be restarted (`RestartableBackend`: the engine process) is
started again after a backoff; meanwhile the worker is not ready, pauses its lanes and
holds the offsets of what the engine held, and those requests resume on the new engine
as after a failover (`RequestFlow.requeue_orphans`). An engine that fails to start at all
goes the same way. The requests held for a down engine wait `engine_wait_s`; then they,
and whatever arrives while it stays down, end with an 'error' marked unavailable (the
gateway answers 503 with `unavailable_message`), while the restarts go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sluice.bus.base import EventBus, TopicPartition
from sluice.bus.topics import request_topic
from sluice.consumers.engine_flow import RequestFlow
from sluice.consumers.engine_poller import LanePoller, PollResult
from sluice.consumers.progress import ProgressStore
from sluice.consumers.worker_config import EngineWorkerConfig
from sluice.engine.backends.base import (
    EngineBackend,
    EngineDeadError,
    RestartableBackend,
)
from sluice.tracing.metrics import LagReporter, watch_engine

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RestartBackoff:
    """How long to wait before restarting a dead engine: `initial_s`, doubling per
    death up to `max_s`, and `initial_s` again after an engine that stayed up
    `reset_after_s` (a crash a day is not a crash loop)."""

    initial_s: float
    max_s: float
    reset_after_s: float
    _next_s: float | None = None

    def delay(self, up_s: float) -> float:
        """The wait before the next start; `up_s`: how long the dead engine ran."""
        if self._next_s is None or up_s >= self.reset_after_s:
            self._next_s = self.initial_s
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay


@dataclass(slots=True)
class WorkerStats:
    """A snapshot for readiness probes and metrics."""

    ready: bool = False  # holds partitions and its engine is up
    healthy: bool = True  # False once it gave up (the engine died for good) or failed
    draining: bool = False
    engine_up: bool = True
    engine_restarts: int = 0
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
        *,
        pool: str,
        model_name: str | None = None,
    ) -> None:
        """`pool`: the model pool it serves (`bus.topics.pool_id` of its model): it reads
        that pool's lanes in group `<group_id>.<pool>`. `model_name`: the served model's
        name on the engine gauges (`vllm:num_requests_*`, `vllm:kv_cache_usage_perc`); None
        exposes no gauges."""
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
        self.model_name = model_name
        self._unwatch_engine: Callable[[], None] | None = None
        self.pool = pool
        self.group_id = f"{config.group_id}.{pool}"  # each pool its own group: own failover
        lanes = [request_topic(lane, pool) for lane in config.lanes]
        self._lag = LagReporter(self.group_id, lanes)
        self._poller = _MeteredPoller(
            bus,
            self.group_id,
            lanes,
            f"{config.control_group_prefix}-{worker_id}-{uuid.uuid4().hex[:8]}",
            self._on_assignment_threadsafe,
            lambda: self._flow.commit_snapshot,
            config.control_max_wait_ms,
        )
        self._flow = RequestFlow(
            bus,
            backend,
            config,
            progress,
            self._io,
            worker_id,
            self.stats,
            self._engine_died,
            pool=pool,
        )
        self._drain_timeout_s = config.drain_timeout_s
        self._flow.mode.restarts_engine = config.restart_engine and isinstance(
            backend, RestartableBackend
        )
        self._backoff = RestartBackoff(
            config.engine_restart_initial_s,
            config.engine_restart_max_s,
            config.engine_restart_reset_s,
        )
        self._joined = False  # the group gave this worker partitions
        self._engine_started_at = 0.0  # loop time
        self._down_since: float | None = None  # loop time the engine went down
        self.down_cause: str | None = None  # why the engine is down (read from any thread)

    # -- lifecycle (any thread) -----------------------------------------------------------
    def run(self) -> None:
        """Serve until `stop()`/`drain()`; raises EngineDeadError if the engine died."""
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

    @property
    def unavailable_message(self) -> str | None:
        """What a request that no engine can serve is told: the cause, and its fix where
        the backend named one; None while the engine is up (or loading the first time)."""
        cause = self.down_cause
        return None if cause is None else f"no engine is up: {cause}"

    def _wake_threadsafe(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(wake.set)

    # -- the loop ---------------------------------------------------------------------
    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        failed_start: EngineDeadError | None = None
        # the control group joins on the Kafka thread while the engine loads
        control = self._loop.run_in_executor(self._kafka, self._poller.open_control)
        try:
            self.backend.start()
        except EngineDeadError as exc:
            if not self._flow.mode.restarts_engine:
                raise
            failed_start = exc  # started again by `_delta_loop`, as a dead engine is
            self._flow.mode.engine_up = self.stats.engine_up = False
            self.down_cause = str(exc)
        self._engine_started_at = self._loop.time()
        if self.model_name is not None:
            self._unwatch_engine = watch_engine(self.model_name, self.backend.stats)
        await control
        await self._on_kafka(self._poller.open_lanes)
        self._flow.publisher.bind(self._loop)
        deltas = asyncio.create_task(self._delta_loop(failed_start), name="engine-deltas")
        ticker = asyncio.create_task(self._tick_loop(), name="engine-ticks")
        poll = asyncio.create_task(self._poll_loop(), name="engine-poll")
        stopping_at = self._loop.time()
        try:
            while not self._stop.is_set() and not poll.done():
                await asyncio.sleep(0.02)
            stopping_at = self._loop.time()
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
            drained_at = self._loop.time()
            await self._shutdown(deltas, poll)
            logger.info(
                "worker=%s stopped: drain %.1fs, shutdown %.1fs",
                self.worker_id,
                drained_at - stopping_at,
                self._loop.time() - drained_at,
            )
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
            if self._lag.due():  # on the poll thread: only it may touch the consumer
                self._lag.report(await self._on_kafka(self._poller.lag))

    def _after_poll(self, result: PollResult) -> None:
        flow = self._flow
        flow.offsets.committed(result.committed)
        self.stats.commits += bool(result.committed)
        self._joined = bool(result.assignment) or self._joined
        self.stats.ready = self._joined and flow.mode.engine_up
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

    async def _delta_loop(self, failed_start: EngineDeadError | None) -> None:
        """Engine steps into the flow; a dead engine (or one that `failed_start`) is
        restarted where it can be."""
        while True:
            if failed_start is None:
                try:
                    async for batch in self.backend.deltas():
                        self._flow.on_step(batch)
                except Exception:
                    logger.exception("worker=%s engine delta stream failed", self.worker_id)
                if self._stop.is_set():
                    return
            if self._flow.mode.restarts_engine and await self._restart_engine(failed_start):
                failed_start = None
                continue
            if not self._stop.is_set():
                logger.error("worker=%s engine stopped; stopping without commit", self.worker_id)
                self.stats.healthy = False
                self._stop.set()
            return

    async def _restart_engine(self, failed_start: EngineDeadError | None = None) -> bool:
        """Start the dead engine (or the one that `failed_start`) again, after a backoff;
        True once it is back.

        First the publisher is flushed: the progress store then holds what clients were
        sent, which the orphaned requests resume from (and a late progress write of the
        dead attempt cannot fence the new one). False when the worker stops meanwhile or
        the engine fails to start `engine_max_failed_starts` times in a row; then what
        waits for it ends with 503.
        """
        loop = asyncio.get_running_loop()
        flow, stats, config = self._flow, self.stats, self.config
        flow.mode.engine_up = stats.engine_up = stats.ready = False
        self._down_since = loop.time()
        if failed_start is not None:
            up_s = 0.0
            logger.error("worker=%s engine failed to start: %s", self.worker_id, failed_start)
        else:
            up_s = loop.time() - self._engine_started_at
            error = getattr(self.backend, "error", None)
            self.down_cause = str(error) if error else "the engine died"
            logger.error(
                "worker=%s engine died after %.1fs up (%s); %s requests wait for its restart",
                self.worker_id,
                up_s,
                error,
                flow.num_orphans,
            )
        await flow.publisher.flush(timeout_s=10.0)
        for failed in range(config.engine_max_failed_starts):
            if not await self._wait_unless_stopped(self._backoff.delay(up_s)):
                return False
            up_s = 0.0  # a start that failed ran for no time
            try:
                await loop.run_in_executor(None, self._restart_backend, loop)
            except EngineDeadError as exc:
                # `down_cause` stays what took the engine down: a backend that cannot
                # start again may only say it was shut down
                logger.error("worker=%s engine restart %s failed: %s", self.worker_id, failed, exc)
                continue
            self._engine_started_at = loop.time()
            self._down_since = self.down_cause = None
            flow.mode.engine_unavailable = False
            stats.engine_restarts += 1
            flow.requeue_orphans()
            flow.mode.engine_up = stats.engine_up = True
            stats.ready = self._joined
            logger.info("worker=%s engine restarted", self.worker_id)
            flow.admit()
            return True
        flow.fail_waiting(self.unavailable_message or "no engine is up")
        await flow.settle(timeout_s=5.0)  # the answers go out before the worker stops
        return False

    def _restart_backend(self, loop: asyncio.AbstractEventLoop) -> None:
        backend = self.backend
        assert isinstance(backend, RestartableBackend)
        backend.restart(loop)

    async def _wait_unless_stopped(self, delay_s: float) -> bool:
        """Sleep `delay_s` unless the worker stops first; True when it did not."""
        loop = asyncio.get_running_loop()
        until = loop.time() + delay_s
        while not self._stop.is_set() and loop.time() < until:
            await asyncio.sleep(min(0.05, until - loop.time()))
        return not self._stop.is_set()

    async def _tick_loop(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_s):  # wait_for can eat a cancel
                    await wake.wait()
            wake.clear()
            self._flow.mode.stopping = self._stop.is_set()
            self._flow.tick()
            self._end_waits_past_bound()
            # a restartable engine's death ends its delta stream: `_delta_loop` heals it
            restarts = self._flow.mode.restarts_engine
            if not restarts and not self.backend.health() and not self._stop.is_set():
                logger.error("worker=%s engine unhealthy; stopping", self.worker_id)
                self.stats.healthy = False
                self._stop.set()

    def _end_waits_past_bound(self) -> None:
        """Once the engine has been down `engine_wait_s`, what waits for it, and what
        arrives while it stays down, ends with 503 (`RequestFlow.fail_waiting`)."""
        since, loop, flow = self._down_since, self._loop, self._flow
        if since is None or loop is None or loop.time() - since < self.config.engine_wait_s:
            return
        message = self.unavailable_message or "no engine is up"
        if not flow.mode.engine_unavailable:
            flow.mode.engine_unavailable = True
            logger.error(
                "worker=%s %s; requests fail with 503 until it is back", self.worker_id, message
            )
        flow.fail_waiting(message)

    async def _drain(self) -> None:
        """Finish what the engine holds within the timeout, then abort the rest.

        Requests still in the admission buffer never started: they stay uncommitted and
        the group hands them to another member.
        """
        self.stats.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        flow = self._flow
        flow.mode.stopping = True
        while flow.num_in_engine and loop.time() < deadline and self.stats.healthy:
            await asyncio.sleep(0.02)
        flow.end_running()
        while flow.num_in_engine and loop.time() < deadline + 5.0 and self.stats.healthy:
            await asyncio.sleep(0.02)
        await self._flow.publisher.flush(timeout_s=10.0)
        logger.info(
            "worker=%s drained; %s requests left for the group", self.worker_id, flow.num_held
        )

    async def _shutdown(self, deltas: asyncio.Task[None], poll: asyncio.Task[None]) -> None:
        if self._unwatch_engine is not None:
            self._unwatch_engine()
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


class _MeteredPoller(LanePoller):
    """The lane poller that also reads its consumer's lag (on the poll thread, as the
    rest of it runs)."""

    def lag(self) -> dict[TopicPartition, int]:
        """Records not yet consumed per held lane partition; {} when it cannot say."""
        consumer = self._consumer
        if consumer is None:
            return {}
        try:
            return consumer.lag()
        except Exception:  # telemetry: a consumer that cannot tell is skipped
            logger.debug("worker lag unavailable", exc_info=True)
            return {}
