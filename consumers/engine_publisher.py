"""Publishes each engine step's messages and confirms them in order, then records progress.

Sits behind the engine worker's delta stream. `publish_step` publishes at once (the bus
keeps per-key order, so steps go out in order without waiting for each other); a single
confirm task then awaits each step's publishes in order, retries any the bus did not
confirm, records the step's progress (one pipelined call), and hands the finished
requests back to the worker, whose offsets only then become committable. Telemetry is
best effort: it never holds back a commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from bus.base import Delivered, EventBus
from bus.codec import encode
from bus.messages import TokenDeltaBatch, UsageRecord
from bus.topics import TELEMETRY_TOPIC, USAGE_TOPIC, reply_topic
from consumers.engine_outputs import WorkItem, build_step
from consumers.progress import ProgressStore, StepProgress
from engine.backends.base import EngineDelta

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
    ) -> None:
        self.bus = bus
        self.progress = progress
        self.worker_id = worker_id
        self._io = io
        self._on_confirmed = on_confirmed
        self._max_backoff_s = max_backoff_s
        self._queue: asyncio.Queue[_Step] | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_messages = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queue = asyncio.Queue()
        self._task = loop.create_task(self._confirm_loop(), name="engine-publisher")

    def publish_step(self, pairs: list[tuple[WorkItem, EngineDelta]]) -> None:
        queue = self._queue
        if queue is None:
            raise RuntimeError("StepPublisher.bind() first")
        out = build_step(pairs, self.worker_id)
        step = _Step(progress=out.progress, finished=out.finished)
        for reply_to, deltas in out.batches.items():
            batch = TokenDeltaBatch(reply_to=reply_to, deltas=deltas)
            step.sends.append(self._send(reply_topic(reply_to), encode(batch), reply_to))
        for usage in out.usage:
            step.sends.append(self._send(USAGE_TOPIC, encode(usage), usage.tenant_id))
        for record in out.telemetry:
            future = self.bus.publish(
                TELEMETRY_TOPIC, encode(record), key=record.request_id.encode()
            )
            future.add_done_callback(_log_telemetry_failure)
        queue.put_nowait(step)

    def publish_usage(self, usage: UsageRecord) -> None:
        """A usage record outside any step (an earlier attempt's, see `superseded_usage`),
        confirmed in order with the steps."""
        queue = self._queue
        if queue is None:
            raise RuntimeError("StepPublisher.bind() first")
        queue.put_nowait(_Step(sends=[self._send(USAGE_TOPIC, encode(usage), usage.tenant_id)]))

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

    async def _record(self, progress: list[StepProgress]) -> set[str]:
        if not progress:
            return set()
        loop = asyncio.get_running_loop()
        try:
            fenced: set[str] = await loop.run_in_executor(self._io, self.progress.record, progress)
        except Exception as exc:  # a failover then resumes from older progress: still correct
            logger.warning("worker=%s progress not recorded: %s", self.worker_id, exc)
            return set()
        return fenced

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every published step is confirmed; False on timeout."""
        if self._queue is None:
            return True
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _log_telemetry_failure(future: Future[Delivered]) -> None:
    exc = future.exception()
    if exc is not None:
        logger.warning("telemetry record not delivered: %s", exc)
