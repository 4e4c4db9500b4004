"""Orphans: the requests a dead engine held, until the worker's restart of it resumes them.

When the engine process dies under a request and the worker restarts it, the request is
ORPHANED (its offset uncommitted) until the engine is back; then it goes back to the
buffer and starts a new attempt from its recorded progress, as after a failover. One the
engine died under `max_engine_deaths` times ends with 'error' instead (it may be what
kills the engine), and so does every orphan when the engine is not coming back.
"""

from __future__ import annotations

import logging

from sluice.consumers.cancels import CancelRegistry
from sluice.consumers.flow_admission import Admission
from sluice.consumers.flow_answers import UnrunAnswers
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.flow_output import FlowOutput
from sluice.consumers.flow_runtime import FlowEnv, ids
from sluice.consumers.work_item import ABORTED, ItemState, WorkItem
from sluice.consumers.worker_requests import is_expired
from sluice.engine.backends.base import EngineDelta

logger = logging.getLogger(__name__)


class Orphans:
    """Orphans a request the engine died under; requeues, fails or expires orphans."""

    def __init__(
        self,
        env: FlowEnv,
        held: HeldRequests,
        admission: Admission,
        answers: UnrunAnswers,
        output: FlowOutput,
        cancels: CancelRegistry,
        max_engine_deaths: int,
    ) -> None:
        self._mode = env.mode
        self._held = held
        self._admission = admission
        self._answers = answers
        self._output = output
        self._cancels = cancels
        self._max_engine_deaths = max_engine_deaths

    def __len__(self) -> int:
        return len(self._all())

    def _all(self) -> list[WorkItem]:
        return [i for i in self._held if i.state is ItemState.ORPHANED]

    def resumes_after_restart(self, item: WorkItem) -> bool:
        """Whether a request the engine just died under waits for the restart, rather
        than ending with 'error': not when this worker stops or no longer owns it, nor
        when the engine died under it `max_engine_deaths` times (it may be what kills it)."""
        if not self._mode.waits_for_restart or item.silent:
            return False
        item.num_engine_deaths += 1
        return item.num_engine_deaths < self._max_engine_deaths

    def orphan(self, item: WorkItem, error: str | None = None) -> None:
        """Hold `item` (offset uncommitted) until the engine is back: `requeue`."""
        if error is not None:
            logger.warning(
                "request_id=%s tenant_id=%s attempt=%s lost with the engine after %s tokens: %s",
                *ids(item),
                item.attempt,
                item.num_generated,
                error,
            )
        item.orphan()
        self._output.restart_stream(item.request_id)

    def requeue(self) -> None:
        """The engine is back: what the dead one held goes back to the buffer and starts
        again, a new attempt resuming from its recorded progress (the worker flushed the
        publisher first, so that progress is what clients were sent). One cancelled
        meanwhile is answered; one whose partition went elsewhere is let go."""
        for item in self._all():
            if item.silent:
                item.done()
                self._held.forget(item)
                continue
            if self._cancels.is_cancelled(item.request):
                item.stop(ABORTED)
            if item.end is not None:
                self._answers.answer([item], item.end)
            else:
                self._admission.requeue(item)
        self._held.update_snapshot()

    def fail(self, error: str, *, unavailable: bool = False) -> None:
        """The engine is not back (in time): what it held ends with 'error', as it would
        without restarts (billed as what this worker received of it); `unavailable`: the
        gateway answers 503 with `error` as the message."""
        pairs = [
            (item, _failed(item.request_id, error, unavailable=unavailable)) for item in self._all()
        ]
        if pairs:
            self._output.step(pairs)

    def expired(self) -> list[WorkItem]:
        """The orphans past their deadline (to be answered: they wait no longer)."""
        return [i for i in self._all() if is_expired(i.deadline)]


def _failed(request_id: str, error: str, *, unavailable: bool) -> EngineDelta:
    return EngineDelta(request_id, finish_reason="error", error=error, unavailable=unavailable)
