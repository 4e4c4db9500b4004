"""Publishes each engine step's messages and confirms them in order, then records progress.

Sits behind the engine worker's delta stream. `publish_step` publishes at once (the bus
keeps per-key order, so steps go out in order without waiting for each other); a single
confirm task then awaits each step's publishes in order, retries any the bus did not
confirm, records the step's progress (one pipelined call), publishes the usage records
of the attempts the step finished (`_confirm_usage`), and hands the finished requests
back to the worker, whose offsets only then become committable. Telemetry is
best effort: it never holds back a commit.

Mid-stream deltas of a reply target go out at most once per `reply_interval_s`: a step
whose deltas for that target are all mid-stream (no first delta of an attempt, nothing
terminal) holds them, and a later step, or a timer at the interval, sends them with its
own in one message. First tokens and terminal deltas never wait; whatever the target
holds goes with them. Held deltas' progress is recorded only once they are sent, so a
failover resumes after what clients were sent, never after what was merely held.
Why: every message costs the broker and the reading gateway, whatever its size, and the
engine steps every few ms. The gateway's reply consumer fetches every
`fetch_max_wait_ms` (5 ms) anyway, so deltas sent a few ms apart mostly arrive together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from sluice.bus.base import Delivered, EventBus
from sluice.bus.codec import encode
from sluice.bus.messages import TelemetryRecord, TokenDeltaBatch, UsageRecord
from sluice.bus.topics import TELEMETRY_TOPIC, USAGE_TOPIC, reply_topic
from sluice.consumers.engine_outputs import DeltaPart, build_step, render
from sluice.consumers.progress import ProgressStore, ProgressUnavailable, StepProgress
from sluice.consumers.progress import call as progress_call
from sluice.consumers.work_item import WorkItem
from sluice.engine.backends.base import EngineDelta
from sluice.tracing.metrics import StepTimer, observe_attempt

logger = logging.getLogger(__name__)

ConfirmedCallback = Callable[[list[WorkItem], set[str]], None]


@dataclass(slots=True)
class _Send:
    topic: str
    value: bytes
    key: bytes | None
    future: Future[Delivered]


@dataclass(slots=True)
class _Step:
    sends: list[_Send] = field(default_factory=list)
    progress: list[StepProgress] = field(default_factory=list)
    finished: list[WorkItem] = field(default_factory=list)
    usage: list[UsageRecord] = field(default_factory=list)  # sent once progress is recorded


@dataclass(slots=True)
class _Held:
    """Mid-stream parts of one reply target waiting for its interval, with their progress."""

    due: float  # loop time by which they go out
    parts: list[DeltaPart] = field(default_factory=list)
    progress: list[StepProgress] = field(default_factory=list)


class StepPublisher:
    """See the module docstring. Used from the worker's event loop thread only."""

    def __init__(
        self,
        bus: EventBus,
        progress: ProgressStore,
        io: Executor,
        worker_id: str,
        on_confirmed: ConfirmedCallback,
        max_backoff_s: float = 2.0,
        reply_interval_s: float = 0.0,
    ) -> None:
        self.bus = bus
        self.progress = progress
        self.worker_id = worker_id
        self._io = io
        self._on_confirmed = on_confirmed
        self._max_backoff_s = max_backoff_s
        self.reply_interval_s = reply_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Step] | None = None
        self._task: asyncio.Task[None] | None = None
        self._held: dict[str, _Held] = {}  # reply target → held deltas
        self._timer: asyncio.TimerHandle | None = None
        self.num_messages = 0
        self.step_timer = StepTimer()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue = asyncio.Queue()
        self._task = loop.create_task(self._confirm_loop(), name="engine-publisher")

    def publish_step(self, pairs: list[tuple[WorkItem, EngineDelta]]) -> None:
        queue, loop = self._queue, self._loop
        if queue is None or loop is None:
            raise RuntimeError("StepPublisher.bind() first")
        out = build_step(pairs, self.worker_id)
        self._observe(pairs, out.usage)
        step = _Step(finished=out.finished, usage=out.usage)
        now = loop.time()
        targets = {item.request_id: item.request.reply_to for item, _ in pairs}
        finished = {item.request_id for item in out.finished}
        release: dict[str, bool] = {}  # reply targets this step touched → send now
        for reply_to, parts in out.batches.items():
            held = self._held.setdefault(reply_to, _Held(due=now + self.reply_interval_s))
            held.parts += parts
            release[reply_to] = release.get(reply_to, False) or any(p.urgent for p in parts)
        for entry in out.progress:
            # a request's progress follows what its target holds, in order (also one
            # without a delta this step, whose client is gone); a finish sends it all
            target = targets[entry.request_id]
            if target in self._held:
                self._held[target].progress.append(entry)
                release[target] = release.get(target, False) or entry.request_id in finished
            else:
                step.progress.append(entry)
        for target, urgent in release.items():
            if urgent or now >= self._held[target].due:
                self._release(target, step)
        self._arm_timer()
        if out.telemetry:
            headers = {item.request_id: item.trace_headers for item in out.finished}
            for record in out.telemetry:
                self.publish_telemetry(record, headers.get(record.request_id, []))
        if step.sends or step.progress or step.finished or step.usage:
            queue.put_nowait(step)

    def _observe(self, pairs: list[tuple[WorkItem, EngineDelta]], usage: list[UsageRecord]) -> None:
        """The step's metrics: its tokens and inter-token gaps, each finished attempt."""
        self.step_timer.step(
            (i.request_id, i.request.model, len(d.token_ids), d.finished) for i, d in pairs
        )
        for record in usage:
            observe_attempt(record)

    def _release(self, target: str, step: _Step) -> None:
        held = self._held.pop(target)
        batch = TokenDeltaBatch(reply_to=target, deltas=render(held.parts))
        step.sends.append(self._send(reply_topic(target), encode(batch), target))
        step.progress += held.progress

    def _arm_timer(self) -> None:
        if self._held and self._timer is None and self._loop is not None:
            due = min(held.due for held in self._held.values())
            self._timer = self._loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        loop = self._loop
        assert loop is not None  # armed only once bound
        self._timer = None
        self._release_held(due_by=loop.time() + 0.001)  # call_at may fire a hair early
        self._arm_timer()

    def _release_held(self, due_by: float | None = None) -> None:
        """Send what reply targets hold (those due by `due_by`, or all) as one step."""
        step = _Step()
        for target in [t for t, h in self._held.items() if due_by is None or h.due <= due_by]:
            self._release(target, step)
        if step.sends and self._queue is not None:
            self._queue.put_nowait(step)

    def publish_usage(self, usage: UsageRecord) -> None:
        """A usage record outside any step (an earlier attempt's, see `superseded_usage`),
        confirmed in order with the steps."""
        queue = self._queue
        if queue is None:
            raise RuntimeError("StepPublisher.bind() first")
        queue.put_nowait(_Step(sends=[self._send(USAGE_TOPIC, encode(usage), usage.tenant_id)]))

    def publish_telemetry(self, record: TelemetryRecord, headers: list[tuple[str, bytes]]) -> None:
        """A telemetry record with its request's trace context (the tracing consumer
        parents its spans there); not confirmed: telemetry never holds a request up."""
        try:
            future = self.bus.publish(
                TELEMETRY_TOPIC, encode(record), key=record.request_id.encode(), headers=headers
            )
        except Exception as exc:  # telemetry must never break the worker
            logger.warning("telemetry record not published: %s", exc)
            return
        future.add_done_callback(_log_telemetry_failure)

    def _send(self, topic: str, value: bytes, key: str) -> _Send:
        self.num_messages += 1
        encoded = key.encode()
        return _Send(topic, value, encoded, self.bus.publish(topic, value, key=encoded))

    async def _confirm_loop(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            step = await queue.get()
            try:
                await self._confirm(step)
                fenced = await self._record(step.progress)
                await self._confirm_usage(step.usage)
                self._on_confirmed(step.finished, fenced)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("worker=%s could not confirm a step", self.worker_id)
            finally:
                queue.task_done()

    async def _confirm(self, step: _Step) -> None:
        for send in step.sends:
            backoff = 0.05
            while True:
                try:
                    await asyncio.wrap_future(send.future)
                    break
                except Exception as exc:
                    logger.warning(
                        "worker=%s publish to %s not confirmed, retrying: %s",
                        self.worker_id,
                        send.topic,
                        exc,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self._max_backoff_s)
                    send.future = self.bus.publish(send.topic, send.value, key=send.key)

    async def _confirm_usage(self, usage: list[UsageRecord]) -> None:
        """A step's usage records go out once its progress is recorded: a worker killed
        in between leaves the finish recorded and no record, which the resumer estimates
        (`FlowOutput.bill_superseded`); the other order left the record and no finish,
        and the resumer ran the finished request again, billing it twice."""
        sends = [self._send(USAGE_TOPIC, encode(r), r.tenant_id) for r in usage]
        if sends:
            await self._confirm(_Step(sends=sends))

    async def _record(self, progress: list[StepProgress]) -> set[str]:
        if not progress:
            return set()
        try:
            fenced = await progress_call(self.progress, self._io, self.progress.record, progress)
        except ProgressUnavailable as exc:  # a failover resumes from older progress: correct
            logger.warning("worker=%s progress not recorded: %s", self.worker_id, exc)
            return set()
        return fenced

    async def flush(self, timeout_s: float) -> bool:
        """Send what is held, then wait until every step is confirmed; False on timeout."""
        if self._queue is None:
            return True
        self._release_held()
        try:
            async with asyncio.timeout(timeout_s):  # wait_for can eat a cancel (3.11)
                await self._queue.join()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


def _log_telemetry_failure(future: Future[Delivered]) -> None:
    exc = future.exception()
    if exc is not None:
        logger.warning("telemetry record not delivered: %s", exc)
