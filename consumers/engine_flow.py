"""The per-request half of the engine worker: from a polled record to a released offset.

Sits inside `consumers.engine_worker`, on its event loop thread (no locks: nothing here
is touched from another thread). A record becomes a `WorkItem`; it waits in the
admission buffer, begins an attempt in the progress store, runs in the engine, and its
deltas go to the `StepPublisher`; once its terminal delta and usage record are
confirmed its offset is done and the low watermark may pass it. Cancels, deadlines,
fencing and lost partitions end items wherever they are, each with exactly one
terminal delta (or none, when another member owns the request now) and one usage
record per attempt that ran.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from bus.base import EventBus, Record, TopicPartition
from bus.codec import decode_as
from bus.errors import DecodeError
from bus.messages import Cancel, GenerateRequest
from bus.topics import reply_topic
from consumers.admission import AdmissionBuffer
from consumers.cancels import CancelRegistry, cancel_matches
from consumers.engine_outputs import (
    ItemState,
    WorkItem,
    now_ms,
    superseded_usage,
    unrun_terminal,
)
from consumers.engine_publisher import StepPublisher
from consumers.loop import publish_dead_letter
from consumers.offsets import OffsetTracker
from consumers.progress import AttemptStart, ProgressStore
from consumers.progress import call as progress_call
from consumers.worker_requests import (
    LANE_PRIORITY,
    deadline_to_monotonic,
    engine_request,
    is_expired,
)
from engine.backends.base import (
    EngineBackend,
    EngineDeadError,
    EngineDelta,
    RequestRejectedError,
)
from engine.sampling import SamplingParamsError

if TYPE_CHECKING:
    from consumers.engine_worker import EngineWorkerConfig, WorkerStats

logger = logging.getLogger(__name__)


class RequestFlow:
    """Items, admission buffer, offsets and cancels of one worker; see the module docstring."""

    def __init__(
        self,
        bus: EventBus,
        backend: EngineBackend,
        config: EngineWorkerConfig,
        progress: ProgressStore,
        io: Executor,
        worker_id: str,
        stats: WorkerStats,
        on_engine_dead: Callable[[], None],
    ) -> None:
        self.bus = bus
        self.backend = backend
        self.config = config
        self.progress = progress
        self.worker_id = worker_id
        self.stats = stats
        self.stopping = False  # draining: admit nothing more
        self._io = io
        self._on_engine_dead = on_engine_dead
        weights = {lane.value: config.lane_weights.get(lane, 1) for lane in config.lanes}
        self._buffer: AdmissionBuffer[WorkItem] = AdmissionBuffer(
            weights, config.tenant_quantum_tokens
        )
        self._items: dict[str, WorkItem] = {}
        self.offsets = OffsetTracker()
        self._cancels = CancelRegistry(config.cancel_ttl_s, config.max_cancelled)
        self.commit_snapshot: dict[TopicPartition, int] = {}
        self._assigned: set[TopicPartition] = set()
        self.num_in_engine = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.publisher = StepPublisher(
            bus,
            progress,
            io,
            worker_id,
            self._after_confirm,
            reply_interval_s=config.reply_interval_s,
        )

    @property
    def num_held(self) -> int:
        return len(self._items)

    def running_ids(self) -> list[str]:
        return [i.request_id for i in self._items.values() if i.state is ItemState.RUNNING]

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def pause_partitions(self, engine_full: bool) -> set[TopicPartition]:
        """Backpressure: partitions with enough buffered (a lookahead when the engine is full)."""
        if self.stopping or not self.stats.healthy:
            return set(self._assigned)
        limit = self.config.max_buffered_per_partition
        if engine_full:
            limit = min(limit, self.config.full_engine_lookahead)
        counts: dict[TopicPartition, int] = {}
        for item in self._buffer:
            counts[item.tp] = counts.get(item.tp, 0) + 1
        return {tp for tp, n in counts.items() if n >= limit}

    def tick(self) -> None:
        self._expire_buffered()
        self._cancels.expire()
        self.admit()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("worker=%s task failed", self.worker_id, exc_info=task.exception())

    # -- records in ---------------------------------------------------------------------
    def on_record(self, record: Record) -> None:
        tp = record.tp
        if tp not in self._assigned or self.offsets.seen(tp, record.offset):
            return  # redelivered after a rebalance: already held or done
        self.offsets.add(tp, record.offset)
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
            self.offsets.done(tp, record.offset)
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
        self.offsets.done(record.tp, record.offset)
        self._update_snapshot()

    def on_control(self, record: Record) -> None:
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
    def on_assignment(self, partitions: set[TopicPartition]) -> None:
        lost = self._assigned - partitions
        self._assigned = set(partitions)
        if not lost:
            return
        self.offsets.drop(lost)
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
    def engine_full(self, extra: int) -> bool:
        config = self.config
        in_engine = self.num_in_engine + extra
        if in_engine >= config.max_in_engine:
            return True
        stats = self.backend.stats()
        waiting = max(stats.num_waiting + stats.num_pending, in_engine - stats.num_running)
        return waiting >= config.max_engine_waiting or stats.kv_usage >= config.max_kv_usage

    def admit(self) -> None:
        if self.stopping or not self.stats.healthy:
            return
        batch: list[WorkItem] = []
        while not self.engine_full(len(batch)):
            item = self._buffer.pop()
            if item is None:
                break
            item.state = ItemState.STARTING
            batch.append(item)
        self._admit_urgent(batch)
        if batch:
            self.num_in_engine += len(batch)
            for item in batch:
                item.in_engine = True
                self._buffer.started(item)
            self._spawn(self._start(batch))

    def _admit_urgent(self, batch: list[WorkItem]) -> None:
        """The most urgent lane passes an engine queue full of less urgent work.

        Under a saturating batch backlog the engine's waiting queue stays full of batch
        requests (preempted ones go back to it) that only leave as running ones finish,
        so the lane-blind `engine_full` would hold an interactive request for seconds.
        The engine's priority scheduling serves it first (and preempts for it), so it may
        enter while fewer than `max_engine_waiting` requests of its own lane wait in the
        engine for their first token; `max_in_engine` and `max_kv_usage` still hold.
        Counting its running requests instead held new ones in this buffer (and paused
        the lane's partition) whenever 8 interactive requests were decoding: measured
        beside a batch backlog, buffered p50 131 ms, p90 1.6 s.
        """
        lane = min((lane.value for lane in self.config.lanes), key=lambda v: LANE_PRIORITY[v])
        if not self._buffer.count(lane):
            return
        config = self.config
        urgent = sum(
            1
            for i in self._items.values()
            if i.in_engine and i.lane == lane and i.first_token_ms is None
        )
        urgent += sum(1 for i in batch if i.lane == lane)
        while self._buffer.count(lane) and urgent < config.max_engine_waiting:
            if self.num_in_engine + len(batch) >= config.max_in_engine:
                return
            if self.backend.stats().kv_usage >= config.max_kv_usage:
                return
            item = self._buffer.pop(lane)
            if item is None:
                return
            item.state = ItemState.STARTING
            batch.append(item)
            urgent += 1

    async def _begin(self, items: list[WorkItem]) -> list[AttemptStart]:
        requests = [(i.request_id, i.request.attempt) for i in items]
        for attempt in range(5):
            try:
                return await progress_call(
                    self.progress, self._io, self.progress.begin_attempts, requests
                )
            except Exception as exc:
                logger.warning(
                    "worker=%s begin_attempts failed (%s): %s", self.worker_id, attempt, exc
                )
                await asyncio.sleep(0.1 * 2**attempt)
        raise RuntimeError("progress store unavailable")

    async def _start(self, items: list[WorkItem]) -> None:
        try:
            starts = await self._begin(items)
        except RuntimeError:  # the progress store is down: back to the buffer, retry later
            for item in items:
                self._leave_engine(item)
                if item.state is ItemState.STARTING and not item.silent:
                    item.state = ItemState.BUFFERED
                    self._buffer.push(item)
            return
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            self._bill_superseded(item, start)
            reason = self._start_blocker(item, start)
            if reason is None:
                reason = self._submit(item)
            if reason is not None:
                self._leave_engine(item)
                self._finish_unrun(item, start, reason)
        self.admit()

    def _bill_superseded(self, item: WorkItem, start: AttemptStart) -> None:
        """An earlier attempt published tokens and then its worker went away: publish its
        usage record, which a kill -9 never sent (the client was told those tokens)."""
        if start.superseded is None:
            return
        attempt, tokens = start.superseded
        logger.info(
            "request_id=%s tenant_id=%s usage of superseded attempt=%s: %s tokens",
            *_ids(item),
            attempt,
            tokens,
        )
        self.publisher.publish_usage(superseded_usage(item, attempt, tokens))

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
            self._on_engine_dead()
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
            self.num_in_engine -= 1
            self._buffer.left(item)

    def _finish_unrun(self, item: WorkItem, start: AttemptStart, reason: str) -> None:
        if reason == "finished" or (item.silent and item.tp not in self._assigned):
            self._items.pop(item.request_id, None)
            self.offsets.done(item.tp, item.offset)
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
        try:
            starts = await self._begin(items)
        except RuntimeError:  # the progress store is down: try again in a while
            await asyncio.sleep(1.0)
            self._spawn(self._answer_unrun_async(items, reason))
            return
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            self._bill_superseded(item, start)
            self._finish_unrun(item, start, "finished" if start.finished else reason)

    # -- deltas out -----------------------------------------------------------------------
    def on_step(self, batch: list[EngineDelta]) -> None:
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
        self.admit()

    def _emit(self, pairs: list[tuple[WorkItem, EngineDelta]]) -> None:
        self.publisher.publish_step(pairs)

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
            self.offsets.done(item.tp, item.offset)
        self._update_snapshot()
        self.refresh_stats()

    def _update_snapshot(self) -> None:
        self.commit_snapshot = self.offsets.watermarks()

    def refresh_stats(self) -> None:
        self.stats.buffered = len(self._buffer)
        self.stats.in_engine = self.num_in_engine
        self.stats.held = len(self._items)


def _ids(obj: WorkItem | GenerateRequest) -> tuple[str, str]:
    return obj.request_id, obj.tenant_id
