"""What the request flow sends out, and what a confirmed step settles.

Engine steps' deltas, usage and telemetry go out through `StepPublisher`
(`consumers.engine_publisher`); here also the usage of a superseded attempt (published
when its successor begins) and dead letters. Once a step's publishes are confirmed and
its progress recorded, the requests it finished are done and release their offsets, and
those a newer attempt fenced stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sluice.bus.base import Record
from sluice.consumers.engine_outputs import superseded_telemetry, superseded_usage
from sluice.consumers.engine_publisher import StepPublisher
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.flow_runtime import FlowEnv, ids
from sluice.consumers.loop import publish_dead_letter
from sluice.consumers.progress import AttemptStart
from sluice.consumers.work_item import FENCED, ItemState, WorkItem
from sluice.engine.backends.base import EngineDelta

logger = logging.getLogger(__name__)


class FlowOutput:
    """Publishes for the flow; settles the requests a confirmed step finished or fenced."""

    def __init__(
        self,
        env: FlowEnv,
        held: HeldRequests,
        reply_interval_s: float,
        on_settled: Callable[[], None],
    ) -> None:
        """`on_settled`: called after each confirmed step's requests are settled."""
        self._env = env
        self._held = held
        self._on_settled = on_settled
        self.publisher = StepPublisher(
            env.bus,
            env.progress,
            env.io,
            env.worker_id,
            self._confirmed,
            reply_interval_s=reply_interval_s,
        )

    def step(self, pairs: list[tuple[WorkItem, EngineDelta]]) -> None:
        self.publisher.publish_step(pairs)

    def restart_stream(self, request_id: str) -> None:
        """The request's next tokens come from a new attempt: time them afresh."""
        self.publisher.step_timer.forget(request_id)

    def bill_superseded(self, item: WorkItem, start: AttemptStart) -> None:
        """An earlier attempt published tokens and then its worker went away: publish its
        usage record, which a kill -9 never sent (the client was told those tokens)."""
        if start.superseded is None:
            return
        attempt, tokens = start.superseded
        logger.info(
            "request_id=%s tenant_id=%s usage of superseded attempt=%s: %s tokens",
            *ids(item),
            attempt,
            tokens,
        )
        usage = superseded_usage(item, attempt, tokens, ended=start.finished)
        self.publisher.publish_usage(usage)
        if not start.finished:  # a finished attempt's own telemetry most likely went out
            self.publisher.publish_telemetry(
                superseded_telemetry(item, attempt, tokens, self._env.worker_id), item.trace_headers
            )

    async def dead_letter(self, record: Record, reason: str) -> None:
        """Park an unusable record on the dead-letter topic; then its offset is done."""
        future = publish_dead_letter(self._env.bus, record, reason, attempts=0)
        await asyncio.wrap_future(future)
        self._env.stats.dead_lettered += 1
        self._held.release(record.tp, record.offset)
        self._held.update_snapshot()

    def _confirmed(self, finished: list[WorkItem], fenced: set[str]) -> None:
        """Publishes of a step are confirmed and progress recorded: release offsets."""
        for request_id in fenced:
            item = self._held.get(request_id)
            if item is not None and not item.silent:
                logger.warning("request_id=%s tenant_id=%s fenced by a newer attempt", *ids(item))
                self._env.stats.fenced += 1
                item.stop(FENCED)
                if item.state is ItemState.RUNNING:
                    self._env.backend.abort(request_id)
        for item in finished:
            self._env.stats.finished += 1
            item.done()
            self._held.forget(item)
            if not item.handed_over:  # its next owner resumes it: the offset stays
                self._held.release(item.tp, item.offset)
        self._held.update_snapshot()
        self._on_settled()
