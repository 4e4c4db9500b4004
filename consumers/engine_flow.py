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

`RequestFlow` coordinates; each `on_*` method is an event, handed to the part that
owns it:

- `HeldRequests` (`flow_held`): the held items, owned partitions, offsets and the
  snapshot of watermarks to commit;
- `Admission` (`flow_admission`): the fair buffer and whether the engine is full;
- `AttemptStarts` (`flow_starts`): begin admitted items' attempts, submit them;
- `UnrunAnswers` (`flow_answers`): answer items that end without running;
- `ItemEndings` (`flow_endings`): cancel, release (partition lost) or hand over an item
  by its state; `FlowCancels` (`flow_cancels`): which items a cancel or a gone
  gateway ends;
- `Orphans` (`flow_orphans`): requests of a dead engine, until its restart;
- `FlowOutput` (`flow_output`): publishing, and settling what a confirmed step finished.

Each part picks the transitions of `consumers.work_item` that the event means for each
item it touches, by the item's state, and does the effects that go with them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Protocol

from sluice.bus.base import EventBus, Record, TopicPartition
from sluice.bus.codec import decode_as
from sluice.bus.errors import DecodeError
from sluice.bus.messages import GenerateRequest
from sluice.bus.topics import Lane, reply_topic
from sluice.consumers.cancels import CancelRegistry
from sluice.consumers.fair_queue import FairQueue
from sluice.consumers.flow_admission import Admission, EngineLimits
from sluice.consumers.flow_answers import UnrunAnswers
from sluice.consumers.flow_cancels import FlowCancels
from sluice.consumers.flow_endings import ItemEndings
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.flow_orphans import Orphans
from sluice.consumers.flow_output import FlowOutput
from sluice.consumers.flow_runtime import FlowEnv, FlowMode, FlowStats, FlowTasks, ids
from sluice.consumers.flow_starts import AttemptStarts
from sluice.consumers.gateway_liveness import GatewayLiveness
from sluice.consumers.progress import ProgressStore
from sluice.consumers.work_item import ABORTED, DEADLINE, EndReason, ItemState, WorkItem, now_ms
from sluice.consumers.worker_load import LoadMeter
from sluice.consumers.worker_requests import LANE_PRIORITY, deadline_to_monotonic, is_expired
from sluice.engine.backends.base import EngineBackend, EngineDelta
from sluice.tracing.propagation import trace_headers

logger = logging.getLogger(__name__)


class FlowConfig(Protocol):
    """What of `consumers.worker_config.EngineWorkerConfig` the flow reads (a protocol,
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


class RequestFlow:
    """The flow of one worker's requests, one event per method; see the module docstring.

    The worker sets `mode` (draining, engine up, restarts), reads `offsets` and
    `commit_snapshot` to commit, and binds, flushes and closes `publisher`.
    """

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
        pool: str | None = None,
    ) -> None:
        env = FlowEnv(
            bus, backend, progress, io, worker_id, stats, FlowMode(), FlowTasks(worker_id)
        )
        self.stats, self.mode, self._tasks = stats, env.mode, env.tasks
        held = self._held = HeldRequests()
        self.offsets = held.offsets
        admission = self._admission = _admission(config, backend, held)
        output = self._output = FlowOutput(env, held, config.reply_interval_s, self.refresh_stats)
        self.publisher = output.publisher
        answers = self._answers = UnrunAnswers(env, held, output)
        self._endings = ItemEndings(env, held, admission, answers)
        cancels = CancelRegistry(config.cancel_ttl_s, config.max_cancelled)
        gateways = GatewayLiveness(worker_id, config.heartbeat_s, config.gateway_ttl_s, pool=pool)
        meter = self._load = LoadMeter()
        self._cancels = FlowCancels(
            env,
            held,
            self._endings,
            cancels,
            gateways,
            lambda: meter.sample(held, backend.stats().num_running),
        )
        deaths = config.max_engine_deaths
        orphans = self._orphans = Orphans(env, held, admission, answers, output, cancels, deaths)
        self._starts = AttemptStarts(env, admission, answers, orphans, output, on_engine_dead)

    @property
    def commit_snapshot(self) -> dict[TopicPartition, int]:
        return self._held.commit_snapshot

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_in_engine(self) -> int:
        return self._admission.num_in_engine

    @property
    def num_orphans(self) -> int:
        return len(self._orphans)

    # -- the worker's loop ------------------------------------------------------------------
    def tick(self) -> None:
        """Deadlines, this worker's heartbeat, gone gateways, old cancels; then admit."""
        self._answer_expired(self._admission.take_expired())
        self._answer_expired(self._orphans.expired())
        self._cancels.tick()
        self.admit()

    def _answer_expired(self, items: list[WorkItem]) -> None:
        if items:
            self._answers.answer(items, DEADLINE)

    def pause_partitions(self, engine_full: bool) -> set[TopicPartition]:
        """Backpressure: partitions with enough buffered, or all while nothing is admitted
        (but none once the engine is unavailable: what comes is answered 503 at once)."""
        if self.mode.engine_unavailable and not self.mode.stopping and self.stats.healthy:
            return set()
        if not self._admits():
            return self._held.assigned()
        return self._admission.partitions_to_pause(engine_full)

    def engine_full(self, extra: int) -> bool:
        """Whether the engine takes no more requests now (`Admission.engine_full`)."""
        return self._admission.engine_full(extra)

    def admit(self) -> None:
        """Start what the engine has room for, unless draining, unhealthy or engine down."""
        if not self._admits():
            return
        batch = self._admission.take()
        if batch:
            self._tasks.spawn(self._start(batch))

    def _admits(self) -> bool:
        return not self.mode.stopping and self.stats.healthy and self.mode.engine_up

    async def _start(self, batch: list[WorkItem]) -> None:
        if await self._starts.start(batch):
            self.admit()

    # -- records in -------------------------------------------------------------------------
    def on_record(self, record: Record) -> None:
        """A polled request: hold it, then buffer it (or answer it: cancelled, expired)."""
        if not self._held.accept(record.tp, record.offset):
            return  # redelivered after a rebalance: already held or done
        request = self._request_of(record)
        if request is None:
            return
        self.stats.received += 1
        if self._held.get(request.request_id) is not None:
            logger.warning("request_id=%s tenant_id=%s delivered twice", *ids(request))
            self._held.release(record.tp, record.offset)
            return
        item = WorkItem(
            request, record.tp, record.offset, deadline_to_monotonic(request.deadline_ms), now_ms()
        )
        item.trace_headers = trace_headers(record.headers)
        self._held.hold(item)
        if self._cancels.is_cancelled(request):
            self._answers.answer([item], ABORTED)
        elif is_expired(item.deadline):
            self._answers.answer([item], DEADLINE)
        else:
            self._admission.push(item)

    def _request_of(self, record: Record) -> GenerateRequest | None:
        """The record's request; None when it goes to the dead-letter topic instead."""
        try:
            request = decode_as(GenerateRequest, record.value)
        except DecodeError as exc:
            self._tasks.spawn(self._output.dead_letter(record, f"decode: {exc}"))
            return None
        try:
            reply_topic(request.reply_to)
        except ValueError as exc:
            self._tasks.spawn(self._output.dead_letter(record, f"reply target: {exc}"))
            return None
        return request

    def on_control(self, record: Record) -> None:
        """A cancel or a heartbeat (`FlowCancels`)."""
        self._cancels.on_control(record)

    def on_assignment(self, partitions: set[TopicPartition]) -> None:
        """A rebalance: what this worker holds of a lost partition is let go."""
        lost = self._held.reassign(partitions)
        if not lost:
            return
        for item in self._held.on_partitions(lost):
            self._endings.release_lost(item)
        self._held.update_snapshot()

    # -- deltas out -------------------------------------------------------------------------
    def on_step(self, batch: list[EngineDelta]) -> None:
        """An engine step: its deltas go out, except those of requests the dead engine
        leaves to its restart (orphans); then admit into the room it made."""
        pairs: list[tuple[WorkItem, EngineDelta]] = []
        for delta in batch:
            item = self._held.get(delta.request_id)
            if item is None or item.state is not ItemState.RUNNING:
                continue
            if delta.token_ids and item.first_token_ms is None:
                self._load.prefilled(item.prompt_tokens)
            if delta.finished and item.first_token_ms is not None:
                self._load.finished((now_ms() - item.first_token_ms) / 1000)
            if delta.finished:
                self._admission.leave_engine(item)
                if delta.retryable and self._orphans.resumes_after_restart(item):
                    self._orphans.orphan(item, delta.error or "the engine died")
                    continue
            pairs.append((item, delta))
        if pairs:
            self._output.step(pairs)
        self.admit()

    # -- a dead engine, the drain -----------------------------------------------------------
    def requeue_orphans(self) -> None:
        """The engine is back: its orphans start again (`Orphans.requeue`)."""
        self._orphans.requeue()
        self.refresh_stats()

    def fail_waiting(self, error: str) -> None:
        """No engine came up in time: the orphans and the buffered requests end with
        'error' marked unavailable (the gateway answers 503 with `error`)."""
        self._orphans.fail(error, unavailable=True)
        buffered = self._admission.take_all()
        if buffered:
            self._answers.answer(buffered, EndReason.unavailable(error))
        self.refresh_stats()

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the tasks the flow spawned, answers included."""
        await self._tasks.wait(timeout_s)

    def end_running(self) -> None:
        """At the drain's deadline: hand over or abort what still runs."""
        self._endings.end_running()

    def cancel_tasks(self) -> None:
        self._tasks.cancel_all()

    def refresh_stats(self) -> None:
        self.stats.buffered = len(self._admission)
        self.stats.in_engine = self._admission.num_in_engine
        self.stats.held = len(self._held)


def _admission(config: FlowConfig, backend: EngineBackend, held: HeldRequests) -> Admission:
    """The admission buffer and engine limits, from the worker's config."""
    weights = {lane.value: config.lane_weights.get(lane, 1) for lane in config.lanes}
    urgent_lane = min((lane.value for lane in config.lanes), key=lambda v: LANE_PRIORITY[v])
    limits = EngineLimits(
        max_in_engine=config.max_in_engine,
        max_engine_waiting=config.max_engine_waiting,
        max_engine_waiting_tokens=config.max_engine_waiting_tokens,
        max_kv_usage=config.max_kv_usage,
        max_buffered_per_partition=config.max_buffered_per_partition,
        full_engine_lookahead=config.full_engine_lookahead,
    )
    buffer: FairQueue[WorkItem] = FairQueue(weights, config.tenant_quantum_tokens)
    return Admission(buffer, urgent_lane, limits, backend, held)
