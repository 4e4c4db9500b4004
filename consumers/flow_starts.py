"""Starting admitted requests: each begins an attempt in the progress store, then runs.

An admitted (STARTING) batch begins its attempts in one progress-store call; a request
resumed after a failover or an engine restart continues from what earlier attempts
published. One that should not run after all (finished by an earlier attempt, cancelled
or expired meanwhile, or already at `max_tokens`) is answered instead; one the engine
rejects ends with 'error'. When the progress store is down the batch goes back to the
buffer; when the engine is down at submit the request waits for its restart (an orphan).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sluice.consumers.flow_admission import Admission
from sluice.consumers.flow_answers import UnrunAnswers, begin_attempts
from sluice.consumers.flow_orphans import Orphans
from sluice.consumers.flow_output import FlowOutput
from sluice.consumers.flow_runtime import FlowEnv, ids
from sluice.consumers.progress import AttemptStart, ProgressUnavailable
from sluice.consumers.work_item import DEADLINE, FINISHED, LENGTH, STOPPED, EndReason, WorkItem
from sluice.consumers.worker_requests import engine_request, is_expired
from sluice.engine.backends.base import EngineDeadError, RequestRejectedError
from sluice.engine.sampling import SamplingParamsError

logger = logging.getLogger(__name__)


class AttemptStarts:
    """Begins admitted items' attempts and submits them to the engine."""

    def __init__(
        self,
        env: FlowEnv,
        admission: Admission,
        answers: UnrunAnswers,
        orphans: Orphans,
        output: FlowOutput,
        on_engine_dead: Callable[[], None],
    ) -> None:
        self._env = env
        self._admission = admission
        self._answers = answers
        self._orphans = orphans
        self._output = output
        self._on_engine_dead = on_engine_dead

    async def start(self, items: list[WorkItem]) -> bool:
        """Begin and submit `items`; False when the progress store was down and they
        went back to the buffer."""
        try:
            starts = await begin_attempts(self._env, items)
        except ProgressUnavailable:  # back to the buffer, retry later
            for item in items:
                self._admission.leave_engine(item)
                if not item.silent:  # a silent one stays held until its partition returns
                    self._admission.requeue(item)
            return False
        for item, start in zip(items, starts, strict=True):
            item.begin(start)
            self._output.bill_superseded(item, start)
            reason = self._blocker(item, start)
            if reason is None:
                reason = self._submit(item)
            if reason is not None:
                self._admission.leave_engine(item)
                self._answers.finish(item, reason)
        return True

    def _blocker(self, item: WorkItem, start: AttemptStart) -> EndReason | None:
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
            self._env.backend.submit(engine_request(item))
        except (RequestRejectedError, SamplingParamsError) as exc:
            logger.warning("request_id=%s tenant_id=%s rejected: %s", *ids(item), exc)
            item.stop(EndReason.error(str(exc)))
            return item.end
        except EngineDeadError:
            return self._engine_dead_at_submit(item)
        item.run()
        if start_tokens := len(item.resumed_token_ids):
            logger.info(
                "request_id=%s tenant_id=%s resumed attempt=%s after %s tokens",
                *ids(item),
                item.attempt,
                start_tokens,
            )
        return None

    def _engine_dead_at_submit(self, item: WorkItem) -> EndReason | None:
        """The item waits for the engine's restart, or, when there is none, the worker
        stops and so does the item."""
        if self._env.mode.waits_for_restart:
            logger.warning("request_id=%s tenant_id=%s engine down at submit", *ids(item))
            self._admission.leave_engine(item)
            self._orphans.orphan(item)
            return None
        logger.error("request_id=%s tenant_id=%s engine dead at submit", *ids(item))
        self._env.stats.healthy = False
        self._on_engine_dead()
        item.stop(STOPPED)
        return item.end
