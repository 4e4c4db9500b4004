"""The per-request half of the engine worker: from a polled record to a released offset.

Sits inside `consumers.engine_worker`, on its event loop thread (no locks: nothing here
is touched from another thread). A record becomes a `WorkItem`; it waits in the
admission buffer, begins an attempt in the progress store, runs in the engine, and its
deltas go to the `StepPublisher`; once its terminal delta and usage record are
confirmed its offset is done and the low watermark may pass it. Cancels, deadlines,
fencing and lost partitions end items wherever they are, each with exactly one
terminal delta (or none, when another member owns the request now) and one usage
record per attempt that ran. When the engine dies under a request and the worker
restarts it, the request is an orphan until the engine is back, then goes back to the
buffer and resumes as after a failover: a new attempt from its recorded progress.

Each `on_*` method is an event; it picks the transitions of `consumers.work_item` that
the event means for each item it touches, by the item's state, and does the effects
(buffer, engine, publisher, offsets) that go with them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

from sluice.bus.base import EventBus, Record, TopicPartition
from sluice.bus.codec import decode_as, encode
from sluice.bus.errors import DecodeError
from sluice.bus.messages import Cancel, GenerateRequest, Heartbeat
from sluice.bus.topics import HEARTBEATS_TOPIC, Lane, reply_topic
from sluice.consumers.cancels import CancelRegistry, cancel_matches
from sluice.consumers.engine_outputs import superseded_telemetry, superseded_usage, unrun_terminal
from sluice.consumers.engine_publisher import StepPublisher
from sluice.consumers.fair_queue import FairQueue
from sluice.consumers.gateway_liveness import GatewayLiveness
from sluice.consumers.loop import publish_dead_letter
from sluice.consumers.offsets import OffsetTracker
from sluice.consumers.progress import AttemptStart, ProgressStore, ProgressUnavailable
from sluice.consumers.progress import call as progress_call
from sluice.consumers.work_item import (
    ABORTED,
    DEADLINE,
    FENCED,
    FINISHED,
    HANDED_OVER,
    LENGTH,
    LOST,
    STOPPED,
    EndKind,
    EndReason,
    ItemState,
    WorkItem,
    now_ms,
)
from sluice.consumers.worker_requests import (
    LANE_PRIORITY,
    deadline_to_monotonic,
    engine_request,
    is_expired,
)
from sluice.engine.backends.base import (
    EngineBackend,
    EngineDeadError,
    EngineDelta,
    RequestRejectedError,
)
from sluice.engine.sampling import SamplingParamsError
from sluice.tracing.propagation import trace_headers

logger = logging.getLogger(__name__)


class FlowConfig(Protocol):
    """What of `consumers.engine_worker.EngineWorkerConfig` the flow reads (a protocol,
    so that the worker imports the flow and not the other way round)."""

    @property
    def lanes(self) -> Sequence[Lane]: ...
    @property
    def lane_weights(self) -> Mapping[Lane, int]: ...
    @property
    def tenant_quantum_tokens(self) -> int: ...
    @property
    def cancel_ttl_s(self) -> float: ...
    @property
    def max_cancelled(self) -> int: ...
    @property
    def reply_interval_s(self) -> float: ...
    @property
    def max_buffered_per_partition(self) -> int: ...
    @property
    def full_engine_lookahead(self) -> int: ...
    @property
    def max_in_engine(self) -> int: ...
    @property
    def max_engine_waiting(self) -> int: ...
    @property
    def max_engine_waiting_tokens(self) -> int: ...
    @property
    def max_kv_usage(self) -> float: ...
    @property
    def max_engine_deaths(self) -> int: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def gateway_ttl_s(self) -> float: ...


class FlowStats(Protocol):
    """The counters of `consumers.engine_worker.WorkerStats` the flow keeps."""

    healthy: bool
    buffered: int
    in_engine: int
    held: int
    received: int
    finished: int
    cancelled: int
    dead_lettered: int
    fenced: int


class RequestFlow:
    """Items, admission buffer, offsets and cancels of one worker; see the module docstring."""

    def __init__(
        self,
        bus: EventBus,
        backend: EngineBackend,
        config: FlowConfig,
        progress: ProgressStore,
        io: Executor,
        worker_id: str,
        stats: FlowStats,
        on_engine_dead: Callable[[], None],
    ) -> None:
        self.bus = bus
        self.backend = backend
        self.config = config
        self.progress = progress
        self.worker_id = worker_id
        self.stats = stats
        self.stopping = False  # draining: admit nothing more
        self.engine_up = True  # False while the worker restarts a dead engine
        self.restarts_engine = False  # the worker restarts a dead engine (it can)
        self._io = io
        self._on_engine_dead = on_engine_dead
        weights = {lane.value: config.lane_weights.get(lane, 1) for lane in config.lanes}
        self._buffer: FairQueue[WorkItem] = FairQueue(weights, config.tenant_quantum_tokens)
        self._items: dict[str, WorkItem] = {}
        self.offsets = OffsetTracker()
        self._cancels = CancelRegistry(config.cancel_ttl_s, config.max_cancelled)
        self._gateways = GatewayLiveness(worker_id, config.heartbeat_s, config.gateway_ttl_s)
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

    def end_running(self) -> None:
        """At the drain's deadline: abort what still runs. With a shared progress store
        each is handed over (silent, its offset uncommitted), so the partition's next owner
        resumes it as after a kill -9 and its client gets every token; with this process's
        own store nobody could resume it, and its client gets 'abort'."""
        hand_over = not self.progress.in_process
        for item in [i for i in self._items.values() if i.state is ItemState.RUNNING]:
            logger.info(
                "request_id=%s tenant_id=%s %s by the drain after %s tokens",
                *_ids(item),
                "handed over" if hand_over else "aborted",
                item.num_generated,
            )
            if hand_over:
                item.stop(HANDED_OVER)
            self.backend.abort(item.request_id)

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def pause_partitions(self, engine_full: bool) -> set[TopicPartition]:
        """Backpressure: partitions with enough buffered (a lookahead when the engine is full)."""
        if self.stopping or not self.stats.healthy or not self.engine_up:
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
        self._expire_orphans()
        self._cancel_for_gone_gateways()
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
        item.trace_headers = trace_headers(record.headers)
        self._items[request.request_id] = item
        if self._cancels.is_cancelled(request):
            self._answer_unrun([item], ABORTED)
        elif is_expired(item.deadline):
            self._answer_unrun([item], DEADLINE)
        else:
            self._buffer.push(item)

    async def _dead_letter(self, record: Record, reason: str) -> None:
        future = publish_dead_letter(self.bus, record, reason, attempts=0)
        await asyncio.wrap_future(future)
        self.stats.dead_lettered += 1
        self.offsets.done(record.tp, record.offset)
        self._update_snapshot()

    def on_control(self, record: Record) -> None:
        if record.topic == HEARTBEATS_TOPIC:
            self._on_heartbeat(record)
            return
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
                self._cancel(item)

    def _on_heartbeat(self, record: Record) -> None:
        try:
            self._gateways.heard(decode_as(Heartbeat, record.value))
        except DecodeError as exc:
            logger.warning("worker=%s undecodable heartbeat: %s", self.worker_id, exc)

    def _cancel_for_gone_gateways(self) -> None:
        """Publish this worker's heartbeat when due; cancel what a gone gateway asked for
        (`consumers.gateway_liveness`)."""
        if self._gateways.due():
            beat = self._gateways.own_beat()
            self.bus.publish(HEARTBEATS_TOPIC, encode(beat), key=self.worker_id.encode())
        gone = self._gateways.gone()
        if not gone:
            return
        for item in list(self._items.values()):
            if item.request.reply_to in gone and item.end is None:
                logger.warning(
                    "request_id=%s tenant_id=%s cancelled: its gateway %s is gone",
                    *_ids(item),
                    item.request.reply_to,
                )
                self._cancel(item)

    def _cancel(self, item: WorkItem) -> None:
        logger.info("request_id=%s tenant_id=%s abort in state %s", *_ids(item), item.state)
        self.stats.cancelled += 1
        match item.state:
            case ItemState.BUFFERED:
                self._buffer.remove(item)
                self._answer_unrun([item], ABORTED)
            case ItemState.ORPHANED:  # waiting for the engine's restart: answer now
                self._answer_unrun([item], ABORTED)
            case ItemState.STARTING:  # `_start` answers it once its attempt began
                item.stop(ABORTED)
            case ItemState.RUNNING:  # the engine ends it with finish_reason 'abort'
                item.stop(ABORTED)
                self.backend.abort(item.request_id)
            case ItemState.FINISHING | ItemState.DONE:
                pass  # its terminal delta is on the way

    def _expire_buffered(self) -> None:
        expired = [i for i in self._buffer if is_expired(i.deadline)]
        for item in expired:
            self._buffer.remove(item)
        if expired:
            self._answer_unrun(expired, DEADLINE)

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
        match item.state:
            case ItemState.BUFFERED:
                self._buffer.remove(item)
                item.done()
                self._forget(item)
            case ItemState.FINISHING | ItemState.DONE:
                pass  # its terminal delta is on the way; let it finish
            case ItemState.STARTING | ItemState.ORPHANED:  # ends at its next transition
                item.stop(LOST)
            case ItemState.RUNNING:
                item.stop(LOST)
                self.backend.abort(item.request_id)

    # -- admission ------------------------------------------------------------------------
    def engine_full(self, extra: int, unstarted_tokens: int | None = None) -> bool:
        """Whether the engine takes no more requests now (`extra` are on their way in).

        Besides the count of waiting requests, the prompt tokens of those without a first
        token yet (`unstarted_tokens`; counted here when None) are held to
        `max_engine_waiting_tokens`, about two steps' worth: enough that the engine's next
        step fills its token budget with prefills, while the rest of a burst waits in the
        fair queue. With a count alone, a burst of short prompts reached the engine a few
        at a time and its last first tokens waited several more steps
        (benchmarks/RESULTS.md, Serving).
        """
        config = self.config
        in_engine = self.num_in_engine + extra
        if in_engine >= config.max_in_engine:
            return True
        stats = self.backend.stats()
        waiting = max(stats.num_waiting + stats.num_pending, in_engine - stats.num_running)
        if waiting >= config.max_engine_waiting or stats.kv_usage >= config.max_kv_usage:
            return True
        if unstarted_tokens is None:
            unstarted_tokens = self._unstarted()[1]
        return unstarted_tokens >= config.max_engine_waiting_tokens

    def _unstarted(self, lane: str | None = None) -> tuple[int, int]:
        """The requests in the engine (of `lane`, or all) without a first token yet, and
        their prompt tokens."""
        items = [
            i
            for i in self._items.values()
            if i.in_engine and i.first_token_ms is None and lane in (None, i.lane)
        ]
        return len(items), sum(i.prompt_tokens for i in items)

    def admit(self) -> None:
        if self.stopping or not self.stats.healthy or not self.engine_up:
            return
        batch: list[WorkItem] = []
        unstarted = self._unstarted()[1]
        while not self.engine_full(len(batch), unstarted):
            item = self._buffer.pop()
            if item is None:
                break
            item.start()
            batch.append(item)
            unstarted += item.prompt_tokens
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
        enter while fewer than `max_engine_waiting` requests (and `max_engine_waiting_tokens`
        prompt tokens) of its own lane wait in the engine for their first token;
        `max_in_engine` and `max_kv_usage` still hold.
        Counting its running requests instead held new ones in this buffer (and paused
        the lane's partition) whenever 8 interactive requests were decoding
        (benchmarks/RESULTS.md).
        """
        lane = min((lane.value for lane in self.config.lanes), key=lambda v: LANE_PRIORITY[v])
        if not self._buffer.count(lane):
            return
        config = self.config
        urgent, tokens = self._unstarted(lane)
        for entering in batch:  # not in the engine yet
            if entering.lane == lane:
                urgent += 1
                tokens += entering.prompt_tokens
        while (
            self._buffer.count(lane)
            and urgent < config.max_engine_waiting
            and tokens < config.max_engine_waiting_tokens
        ):
            if self.num_in_engine + len(batch) >= config.max_in_engine:
                return
            if self.backend.stats().kv_usage >= config.max_kv_usage:
                return
            item = self._buffer.pop(lane)
            if item is None:
                return
            item.start()
            batch.append(item)
            urgent += 1
            tokens += item.prompt_tokens

    async def _begin(self, items: list[WorkItem]) -> list[AttemptStart]:
        """Begin the items' attempts; raises ProgressUnavailable after 5 tries (3.1 s)."""
        requests = [(i.request_id, i.request.attempt) for i in items]
        for attempt in range(5):
            try:
                return await progress_call(
                    self.progress, self._io, self.progress.begin_attempts, requests
                )
            except ProgressUnavailable as exc:
                logger.warning(
                    "worker=%s begin_attempts failed (%s): %s", self.worker_id, attempt, exc
                )
                await asyncio.sleep(0.1 * 2**attempt)
        raise ProgressUnavailable(f"begin_attempts failed 5 times ({len(items)} requests)")

    async def _start(self, items: list[WorkItem]) -> None:
        try:
            starts = await self._begin(items)
        except ProgressUnavailable:  # back to the buffer, retry later
            for item in items:
                self._leave_engine(item)
                if not item.silent:  # a silent one stays held until its partition returns
                    item.requeue()
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
                self._finish_unrun(item, reason)
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
        usage = superseded_usage(item, attempt, tokens, ended=start.finished)
        self.publisher.publish_usage(usage)
        if not start.finished:  # a finished attempt's own telemetry most likely went out
            self.publisher.publish_telemetry(
                superseded_telemetry(item, attempt, tokens, self.worker_id), item.trace_headers
            )

    def _start_blocker(self, item: WorkItem, start: AttemptStart) -> EndReason | None:
        """Why the attempt that just began ends before it runs, if it does."""
        if start.finished:
            return FINISHED
        if item.end is not None:
            return item.end
        if is_expired(item.deadline):
            return DEADLINE
        if start.token_ids and len(start.token_ids) >= item.request.sampling.max_tokens:
            return LENGTH
        return None

    def _submit(self, item: WorkItem) -> EndReason | None:
        try:
            self.backend.submit(engine_request(item))
        except (RequestRejectedError, SamplingParamsError) as exc:
            logger.warning("request_id=%s tenant_id=%s rejected: %s", *_ids(item), exc)
            item.stop(EndReason.error(str(exc)))
            return item.end
        except EngineDeadError:
            if self.restarts_engine and not self.stopping:
                logger.warning("request_id=%s tenant_id=%s engine down at submit", *_ids(item))
                self._leave_engine(item)
                self._orphan(item)
                return None
            logger.error("request_id=%s tenant_id=%s engine dead at submit", *_ids(item))
            self.stats.healthy = False
            self._on_engine_dead()
            item.stop(STOPPED)
            return item.end
        item.run()
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

    def _finish_unrun(self, item: WorkItem, reason: EndReason) -> None:
        """End a STARTING item that will not run: a terminal delta (usage only when
        silent), or nothing at all when an earlier attempt finished it or its partition
        is gone."""
        if reason.kind is EndKind.FINISHED or (item.silent and item.tp not in self._assigned):
            item.done()
            self._forget(item)
            self.offsets.done(item.tp, item.offset)
            self._update_snapshot()
            return
        self._emit([(item, unrun_terminal(item, reason))])

    def _forget(self, item: WorkItem) -> None:
        if self._items.get(item.request_id) is item:
            del self._items[item.request_id]

    def _answer_unrun(self, items: list[WorkItem], reason: EndReason) -> None:
        """Answer BUFFERED or ORPHANED items with `reason` once their attempt began."""
        for item in items:
            item.stop(reason)
            item.start()
        self._spawn(self._answer_unrun_async(items, reason))

    async def _answer_unrun_async(self, items: list[WorkItem], reason: EndReason) -> None:
        try:
            starts = await self._begin(items)
        except ProgressUnavailable:  # try again in a while
            await asyncio.sleep(1.0)
            self._spawn(self._answer_unrun_async(items, reason))
            return
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            self._bill_superseded(item, start)
            self._finish_unrun(item, FINISHED if start.finished else reason)

    # -- deltas out -----------------------------------------------------------------------
    def on_step(self, batch: list[EngineDelta]) -> None:
        pairs: list[tuple[WorkItem, EngineDelta]] = []
        for delta in batch:
            item = self._items.get(delta.request_id)
            if item is None or item.state is not ItemState.RUNNING:
                continue
            if delta.finished:
                self._leave_engine(item)
                if delta.retryable and self._resumes_after_restart(item):
                    self._orphan(item, delta.error or "the engine died")
                    continue
            pairs.append((item, delta))
        if pairs:
            self._emit(pairs)
        self.admit()

    # -- a dead engine -------------------------------------------------------------------
    def _resumes_after_restart(self, item: WorkItem) -> bool:
        """Whether a request the engine just died under waits for the restart, rather
        than ending with 'error': not when this worker stops or no longer owns it, nor
        when the engine died under it `max_engine_deaths` times (it may be what kills it)."""
        if not self.restarts_engine or self.stopping or item.silent:
            return False
        item.num_engine_deaths += 1
        return item.num_engine_deaths < self.config.max_engine_deaths

    def _orphan(self, item: WorkItem, error: str | None = None) -> None:
        """Hold `item` (offset uncommitted) until the engine is back: `requeue_orphans`."""
        if error is not None:
            logger.warning(
                "request_id=%s tenant_id=%s attempt=%s lost with the engine after %s tokens: %s",
                *_ids(item),
                item.attempt,
                item.num_generated,
                error,
            )
        item.orphan()
        self.publisher.step_timer.forget(item.request_id)  # its next tokens start afresh

    def _orphans(self) -> list[WorkItem]:
        return [i for i in self._items.values() if i.state is ItemState.ORPHANED]

    def requeue_orphans(self) -> None:
        """The engine is back: what the dead one held goes back to the buffer and starts
        again through `_start`, a new attempt resuming from its recorded progress (the
        worker flushed the publisher first, so that progress is what clients were sent).
        One cancelled meanwhile is answered; one whose partition went elsewhere is let go."""
        for item in self._orphans():
            if item.silent:
                item.done()
                self._forget(item)
                continue
            if self._cancels.is_cancelled(item.request):
                item.stop(ABORTED)
            if item.end is not None:
                self._answer_unrun([item], item.end)
            else:
                item.requeue()
                self._buffer.push(item)
        self._update_snapshot()
        self.refresh_stats()

    def fail_orphans(self, error: str) -> None:
        """The engine is not coming back: what it held ends with 'error', as it would
        without restarts (billed as what this worker received of it)."""
        pairs = [
            (item, EngineDelta(item.request_id, finish_reason="error", error=error))
            for item in self._orphans()
        ]
        if pairs:
            self._emit(pairs)

    def _expire_orphans(self) -> None:
        expired = [i for i in self._orphans() if is_expired(i.deadline)]
        if expired:
            self._answer_unrun(expired, DEADLINE)

    @property
    def num_orphans(self) -> int:
        return len(self._orphans())

    def _emit(self, pairs: list[tuple[WorkItem, EngineDelta]]) -> None:
        self.publisher.publish_step(pairs)

    def _after_confirm(self, finished: list[WorkItem], fenced: set[str]) -> None:
        """Publishes of a step are confirmed and progress recorded: release offsets."""
        for request_id in fenced:
            item = self._items.get(request_id)
            if item is not None and not item.silent:
                logger.warning("request_id=%s tenant_id=%s fenced by a newer attempt", *_ids(item))
                self.stats.fenced += 1
                item.stop(FENCED)
                if item.state is ItemState.RUNNING:
                    self.backend.abort(request_id)
        for item in finished:
            self.stats.finished += 1
            item.done()
            self._forget(item)
            if not item.handed_over:
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
