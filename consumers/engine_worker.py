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
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bus.base import EventBus, Record, TopicPartition
from bus.codec import decode_as
from bus.errors import DecodeError
from bus.messages import Cancel, GenerateRequest
from bus.topics import Lane, reply_topic, request_topic
from consumers.admission import AdmissionBuffer
from consumers.cancels import CancelRegistry, cancel_matches
from consumers.engine_outputs import ItemState, WorkItem, now_ms, unrun_terminal
from consumers.engine_poller import LanePoller, PollResult
from consumers.engine_publisher import StepPublisher
from consumers.loop import publish_dead_letter
from consumers.offsets import OffsetTracker
from consumers.progress import AttemptStart, ProgressStore
from consumers.worker_requests import deadline_to_monotonic, engine_request, is_expired
from engine.backends.base import (
    EngineBackend,
    EngineDeadError,
    EngineDelta,
    RequestRejectedError,
)
from engine.sampling import SamplingParamsError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineWorkerConfig:
    """Tuning of one engine worker; `sluice.settings.EngineWorkerSettings` builds it.

    Backpressure: lanes are paused while the engine is full (waiting + pending requests
    at `max_engine_waiting`, KV usage at `max_kv_usage`, or `max_in_engine` requests
    submitted) and the lane already has buffered requests, or whenever a lane buffers
    `max_buffered_per_lane` requests.
    """

    group_id: str = "engine"
    lanes: tuple[Lane, ...] = (Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH)
    lane_weights: Mapping[Lane, int] = field(
        default_factory=lambda: {Lane.INTERACTIVE: 16, Lane.STANDARD: 4, Lane.BATCH: 1}
    )
    tenant_quantum_tokens: int = 512
    poll_timeout_s: float = 0.05
    max_records: int = 64
    max_buffered_per_lane: int = 64
    max_engine_waiting: int = 8
    max_kv_usage: float = 0.9
    max_in_engine: int = 128
    cancel_ttl_s: float = 600.0
    max_cancelled: int = 100_000
    drain_timeout_s: float = 30.0
    tick_s: float = 0.05
    control_group_prefix: str = "engine-control"


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
        weights = {lane.value: config.lane_weights.get(lane, 1) for lane in config.lanes}
        self._buffer: AdmissionBuffer[WorkItem] = AdmissionBuffer(
            weights, config.tenant_quantum_tokens
        )
        self._items: dict[str, WorkItem] = {}
        self._offsets = OffsetTracker()
        self._cancels = CancelRegistry(config.cancel_ttl_s, config.max_cancelled)
        self._commit_snapshot: dict[TopicPartition, int] = {}
        self._assigned: set[TopicPartition] = set()
        self._num_in_engine = 0
        self._stop = threading.Event()
        self._abandon = False
        self._polling = True
        self._done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._kafka = ThreadPoolExecutor(1, thread_name_prefix=f"sluice-poll-{worker_id}")
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"sluice-progress-{worker_id}")
        self._poller = LanePoller(
            bus,
            config.group_id,
            [request_topic(lane) for lane in config.lanes],
            f"{config.control_group_prefix}-{worker_id}-{uuid.uuid4().hex[:8]}",
            self._on_assignment_threadsafe,
            lambda: self._commit_snapshot,
        )
        self._publisher = StepPublisher(bus, progress, self._io, worker_id, self._after_confirm)
        self._drain_timeout_s = config.drain_timeout_s

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

    def _wake_threadsafe(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(wake.set)

    # -- the loop ---------------------------------------------------------------------
    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.backend.start()
        await self._on_kafka(self._poller.open)
        self._publisher.bind(self._loop)
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
                committed = await self._on_kafka(self._poller.commit, self._offsets.to_commit())
                self._offsets.committed(committed)
        finally:
            self._polling = False
            ticker.cancel()
            if self._abandon:
                deltas.cancel()
                self._publisher.close()
            await self._shutdown(deltas, poll)
        if not self.stats.healthy:
            raise EngineDeadError("the engine died; this worker stopped")

    async def _on_kafka(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._kafka, fn, *args)

    async def _poll_loop(self) -> None:
        config = self.config
        while self._polling and not self._abandon:
            commits = self._offsets.to_commit()
            result: PollResult = await self._on_kafka(
                self._poller.cycle,
                commits,
                self._pause_topics(),
                config.poll_timeout_s,
                config.max_records,
            )
            if not self._abandon:
                self._after_poll(result)

    def _after_poll(self, result: PollResult) -> None:
        self._offsets.committed(result.committed)
        self.stats.commits += bool(result.committed)
        self.stats.ready = bool(result.assignment) or self.stats.ready
        self.stats.assigned, self.stats.paused = len(result.assignment), len(result.paused)
        for record in result.controls:
            self._on_control(record)
        for record in result.records:
            self._on_record(record)
        self._admit()
        self._refresh_stats()

    def _pause_topics(self) -> set[str]:
        if self._stop.is_set() or not self.stats.healthy:
            return {request_topic(lane) for lane in self.config.lanes}
        full = self._engine_full(0)
        limit = 1 if full else self.config.max_buffered_per_lane
        return {
            request_topic(lane)
            for lane in self.config.lanes
            if self._buffer.count(lane.value) >= limit
        }

    async def _delta_loop(self) -> None:
        try:
            async for batch in self.backend.deltas():
                self._on_step(batch)
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
                await asyncio.wait_for(wake.wait(), self.config.tick_s)
            wake.clear()
            self._expire_buffered()
            self._cancels.expire()
            self._admit()
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
        while self._num_in_engine and loop.time() < deadline and self.stats.healthy:
            await asyncio.sleep(0.02)
        for item in list(self._items.values()):
            if item.state is ItemState.RUNNING:
                logger.info("request_id=%s tenant_id=%s aborted by drain", *_ids(item))
                self.backend.abort(item.request_id)
        while self._num_in_engine and loop.time() < deadline + 5.0 and self.stats.healthy:
            await asyncio.sleep(0.02)
        await self._publisher.flush(timeout_s=10.0)
        logger.info(
            "worker=%s drained; %s requests left for the group", self.worker_id, len(self._items)
        )

    async def _shutdown(self, deltas: asyncio.Task[None], poll: asyncio.Task[None]) -> None:
        self.backend.shutdown(5.0)
        for task in (deltas, poll):
            if not task.done():
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(task, 5.0)
        for task in list(self._tasks):
            task.cancel()
        self._publisher.close()
        await self._on_kafka(self._poller.close)
        self._kafka.shutdown(wait=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._refresh_stats()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("worker=%s task failed", self.worker_id, exc_info=task.exception())

    # -- records in ---------------------------------------------------------------------
    def _on_record(self, record: Record) -> None:
        tp = record.tp
        if tp not in self._assigned or self._offsets.seen(tp, record.offset):
            return  # redelivered after a rebalance: already held or done
        self._offsets.add(tp, record.offset)
        try:
            request = decode_as(GenerateRequest, record.value)
        except DecodeError as exc:
            self._spawn(self._dead_letter(record, f"decode: {exc}"))
            return
        try:
            reply_topic(request.reply_to)
        except ValueError as exc:
            self._spawn(self._dead_letter(record, f"reply target: {exc}"))
            return
        self.stats.received += 1
        if request.request_id in self._items:
            logger.warning("request_id=%s tenant_id=%s delivered twice", *_ids(request))
            self._offsets.done(tp, record.offset)
            return
        item = WorkItem(
            request, tp, record.offset, deadline_to_monotonic(request.deadline_ms), now_ms()
        )
        self._items[request.request_id] = item
        if self._cancels.is_cancelled(request):
            self._answer_unrun([item], "abort")
        elif is_expired(item.deadline):
            self._answer_unrun([item], "deadline")
        else:
            self._buffer.push(item)

    async def _dead_letter(self, record: Record, reason: str) -> None:
        future = publish_dead_letter(self.bus, record, reason, attempts=0)
        await asyncio.wrap_future(future)
        self.stats.dead_lettered += 1
        self._offsets.done(record.tp, record.offset)
        self._update_snapshot()

    def _on_control(self, record: Record) -> None:
        try:
            cancel = decode_as(Cancel, record.value)
        except DecodeError as exc:
            logger.warning("worker=%s undecodable control message: %s", self.worker_id, exc)
            return
        self._cancels.add(cancel)
        if cancel.request_id is not None:
            item = self._items.get(cancel.request_id)
            targets = [item] if item is not None else []
        else:
            targets = list(self._items.values())
        for item in targets:
            if cancel_matches(cancel, item.request):
                self._cancel(item, "abort")

    def _cancel(self, item: WorkItem, reason: str) -> None:
        logger.info("request_id=%s tenant_id=%s %s in state %s", *_ids(item), reason, item.state)
        self.stats.cancelled += 1
        if item.state is ItemState.BUFFERED:
            self._buffer.remove(item)
            self._answer_unrun([item], reason)
        elif item.state is ItemState.STARTING:
            item.pending_reason = reason
        elif item.state is ItemState.RUNNING:
            self.backend.abort(item.request_id)

    def _expire_buffered(self) -> None:
        expired = [i for i in self._buffer if is_expired(i.deadline)]
        for item in expired:
            self._buffer.remove(item)
        if expired:
            self._answer_unrun(expired, "deadline")

    # -- rebalances -----------------------------------------------------------------------
    def _on_assignment_threadsafe(self, partitions: set[TopicPartition]) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._on_assignment, partitions)

    def _on_assignment(self, partitions: set[TopicPartition]) -> None:
        lost = self._assigned - partitions
        self._assigned = set(partitions)
        if not lost:
            return
        self._offsets.drop(lost)
        for item in [i for i in self._items.values() if i.tp in lost]:
            self._release_lost(item)
        self._update_snapshot()

    def _release_lost(self, item: WorkItem) -> None:
        """Another member owns this request now: stop without telling the client."""
        logger.info("request_id=%s tenant_id=%s partition lost; released", *_ids(item))
        if item.state is ItemState.BUFFERED:
            self._buffer.remove(item)
            del self._items[item.request_id]
        elif item.state is ItemState.FINISHING:
            return  # its terminal delta is on the way; let it finish
        else:
            item.silent = True
            item.pending_reason = "abort"
            if item.state is ItemState.RUNNING:
                self.backend.abort(item.request_id)

    # -- admission ------------------------------------------------------------------------
    def _engine_full(self, extra: int) -> bool:
        config = self.config
        in_engine = self._num_in_engine + extra
        if in_engine >= config.max_in_engine:
            return True
        stats = self.backend.stats()
        waiting = max(stats.num_waiting + stats.num_pending, in_engine - stats.num_running)
        return waiting >= config.max_engine_waiting or stats.kv_usage >= config.max_kv_usage

    def _admit(self) -> None:
        if self._stop.is_set() or not self.stats.healthy:
            return
        batch: list[WorkItem] = []
        while not self._engine_full(len(batch)):
            item = self._buffer.pop()
            if item is None:
                break
            item.state = ItemState.STARTING
            batch.append(item)
        if batch:
            self._num_in_engine += len(batch)
            for item in batch:
                item.in_engine = True
            self._spawn(self._start(batch))

    async def _begin(self, items: list[WorkItem]) -> list[AttemptStart]:
        requests = [(i.request_id, i.request.attempt) for i in items]
        loop = asyncio.get_running_loop()
        for attempt in range(5):
            try:
                result: list[AttemptStart] = await loop.run_in_executor(
                    self._io, self.progress.begin_attempts, requests
                )
                return result
            except Exception as exc:
                logger.warning(
                    "worker=%s begin_attempts failed (%s): %s", self.worker_id, attempt, exc
                )
                await asyncio.sleep(0.1 * 2**attempt)
        raise RuntimeError("progress store unavailable")

    async def _start(self, items: list[WorkItem]) -> None:
        starts = await self._begin(items)
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            reason = self._start_blocker(item, start)
            if reason is None:
                reason = self._submit(item)
            if reason is not None:
                self._leave_engine(item)
                self._finish_unrun(item, start, reason)
        self._admit()

    def _start_blocker(self, item: WorkItem, start: AttemptStart) -> str | None:
        if start.finished:
            return "finished"
        if item.pending_reason is not None:
            return item.pending_reason
        if is_expired(item.deadline):
            return "deadline"
        if start.token_ids and len(start.token_ids) >= item.request.sampling.max_tokens:
            return "length"
        return None

    def _submit(self, item: WorkItem) -> str | None:
        try:
            self.backend.submit(engine_request(item))
        except (RequestRejectedError, SamplingParamsError) as exc:
            logger.warning("request_id=%s tenant_id=%s rejected: %s", *_ids(item), exc)
            item.pending_reason = f"error:{exc}"
            return item.pending_reason
        except EngineDeadError:
            logger.error("request_id=%s tenant_id=%s engine dead at submit", *_ids(item))
            self.stats.healthy = False
            self._stop.set()
            item.silent = True
            return "abort"
        item.state = ItemState.RUNNING
        item.scheduled_ms = now_ms()
        if start_tokens := len(item.resumed_token_ids):
            logger.info(
                "request_id=%s tenant_id=%s resumed attempt=%s after %s tokens",
                *_ids(item),
                item.attempt,
                start_tokens,
            )
        return None

    def _leave_engine(self, item: WorkItem) -> None:
        if item.in_engine:
            item.in_engine = False
            self._num_in_engine -= 1

    def _finish_unrun(self, item: WorkItem, start: AttemptStart, reason: str) -> None:
        if reason == "finished" or (item.silent and item.tp not in self._assigned):
            self._items.pop(item.request_id, None)
            self._offsets.done(item.tp, item.offset)
            self._update_snapshot()
            return
        error = None
        if reason.startswith("error:"):
            reason, error = "error", reason.removeprefix("error:")
        self._emit([(item, unrun_terminal(item, reason, error))])

    def _answer_unrun(self, items: list[WorkItem], reason: str) -> None:
        for item in items:
            item.state = ItemState.STARTING
        self._spawn(self._answer_unrun_async(items, reason))

    async def _answer_unrun_async(self, items: list[WorkItem], reason: str) -> None:
        starts = await self._begin(items)
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            self._finish_unrun(item, start, "finished" if start.finished else reason)

    # -- deltas out -----------------------------------------------------------------------
    def _on_step(self, batch: list[EngineDelta]) -> None:
        pairs: list[tuple[WorkItem, EngineDelta]] = []
        for delta in batch:
            item = self._items.get(delta.request_id)
            if item is None or item.state is not ItemState.RUNNING:
                continue
            if delta.finished:
                self._leave_engine(item)
            pairs.append((item, delta))
        if pairs:
            self._emit(pairs)
        self._admit()

    def _emit(self, pairs: list[tuple[WorkItem, EngineDelta]]) -> None:
        self._publisher.publish_step(pairs)

    def _after_confirm(self, finished: list[WorkItem], fenced: set[str]) -> None:
        """Publishes of a step are confirmed and progress recorded: release offsets."""
        for request_id in fenced:
            item = self._items.get(request_id)
            if item is not None and not item.silent:
                logger.warning("request_id=%s tenant_id=%s fenced by a newer attempt", *_ids(item))
                self.stats.fenced += 1
                item.silent = True
                if item.state is ItemState.RUNNING:
                    self.backend.abort(request_id)
        for item in finished:
            self.stats.finished += 1
            if self._items.get(item.request_id) is item:
                del self._items[item.request_id]
            self._offsets.done(item.tp, item.offset)
        self._update_snapshot()
        self._refresh_stats()

    def _update_snapshot(self) -> None:
        self._commit_snapshot = self._offsets.watermarks()

    def _refresh_stats(self) -> None:
        self.stats.buffered = len(self._buffer)
        self.stats.in_engine = self._num_in_engine
        self.stats.held = len(self._items)


def _ids(obj: WorkItem | GenerateRequest) -> tuple[str, str]:
    return obj.request_id, obj.tenant_id
