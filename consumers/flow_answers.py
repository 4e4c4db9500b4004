"""Answering requests that end without running: cancelled, expired, or already finished.

An answer, like a run, is an attempt: it begins in the progress store first
(`begin_attempts`), which says whether an earlier attempt finished the request and
bills one that was superseded; then one terminal delta goes out (usage only when
silent), or nothing at all when an earlier attempt finished the request or its
partition is gone.
"""

from __future__ import annotations

import asyncio
import logging

from sluice.consumers.engine_outputs import unrun_terminal
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.flow_output import FlowOutput
from sluice.consumers.flow_runtime import FlowEnv
from sluice.consumers.progress import AttemptStart, ProgressUnavailable
from sluice.consumers.progress import call as progress_call
from sluice.consumers.work_item import FINISHED, EndKind, EndReason, WorkItem

logger = logging.getLogger(__name__)


async def begin_attempts(env: FlowEnv, items: list[WorkItem]) -> list[AttemptStart]:
    """Begin the items' attempts; raises ProgressUnavailable after 5 tries (3.1 s)."""
    requests = [(i.request_id, i.request.attempt) for i in items]
    progress = env.progress
    for attempt in range(5):
        try:
            return await progress_call(progress, env.io, progress.begin_attempts, requests)
        except ProgressUnavailable as exc:
            logger.warning("worker=%s begin_attempts failed (%s): %s", env.worker_id, attempt, exc)
            await asyncio.sleep(0.1 * 2**attempt)
    raise ProgressUnavailable(f"begin_attempts failed 5 times ({len(items)} requests)")


class UnrunAnswers:
    """Ends STARTING items that will not run, and answers BUFFERED or ORPHANED ones."""

    def __init__(self, env: FlowEnv, held: HeldRequests, output: FlowOutput) -> None:
        self._env = env
        self._held = held
        self._output = output

    def answer(self, items: list[WorkItem], reason: EndReason) -> None:
        """Answer BUFFERED or ORPHANED items with `reason` once their attempt began."""
        for item in items:
            item.stop(reason)
            item.start()
        self._env.tasks.spawn(self._answer_once_begun(items, reason))

    async def _answer_once_begun(self, items: list[WorkItem], reason: EndReason) -> None:
        try:
            starts = await begin_attempts(self._env, items)
        except ProgressUnavailable:  # try again in a while
            await asyncio.sleep(1.0)
            self._env.tasks.spawn(self._answer_once_begun(items, reason))
            return
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            self._output.bill_superseded(item, start)
            self.finish(item, FINISHED if start.finished else reason)

    def finish(self, item: WorkItem, reason: EndReason) -> None:
        """End a STARTING item that will not run: a terminal delta (usage only when
        silent), or nothing at all when an earlier attempt finished it or its partition
        is gone."""
        if reason.kind is EndKind.FINISHED or (item.silent and not self._held.owns(item.tp)):
            item.done()
            self._held.forget(item)
            self._held.release(item.tp, item.offset)
            self._held.update_snapshot()
            return
        self._output.step([(item, unrun_terminal(item, reason))])
