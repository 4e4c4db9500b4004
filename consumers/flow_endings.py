"""Ending a held request wherever it is: cancelled, its partition lost, or drained.

Each ending picks, by the item's state, what ends it: a BUFFERED or ORPHANED item is
answered at once (`consumers.flow_answers`), a STARTING one ends once its attempt began,
a RUNNING one by the engine's abort; a FINISHING or DONE one already has its terminal
delta on the way. Every request gets exactly one terminal delta, or none when another
member owns it now.
"""

from __future__ import annotations

import logging

from sluice.consumers.flow_admission import Admission
from sluice.consumers.flow_answers import UnrunAnswers
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.flow_runtime import FlowEnv, ids
from sluice.consumers.work_item import ABORTED, HANDED_OVER, LOST, ItemState, WorkItem

logger = logging.getLogger(__name__)


class ItemEndings:
    """Cancel, release (partition lost) or hand over (drain deadline) held items."""

    def __init__(
        self,
        env: FlowEnv,
        held: HeldRequests,
        admission: Admission,
        answers: UnrunAnswers,
    ) -> None:
        self._env = env
        self._held = held
        self._admission = admission
        self._answers = answers

    def cancel(self, item: WorkItem) -> None:
        logger.info("request_id=%s tenant_id=%s abort in state %s", *ids(item), item.state)
        self._env.stats.cancelled += 1
        match item.state:
            case ItemState.BUFFERED:
                self._admission.remove(item)
                self._answers.answer([item], ABORTED)
            case ItemState.ORPHANED:  # waiting for the engine's restart: answer now
                self._answers.answer([item], ABORTED)
            case ItemState.STARTING:  # its start answers it once its attempt began
                item.stop(ABORTED)
            case ItemState.RUNNING:  # the engine ends it with finish_reason 'abort'
                item.stop(ABORTED)
                self._env.backend.abort(item.request_id)
            case ItemState.FINISHING | ItemState.DONE:
                pass  # its terminal delta is on the way

    def release_lost(self, item: WorkItem) -> None:
        """Another member owns this request now: stop without telling the client."""
        logger.info("request_id=%s tenant_id=%s partition lost; released", *ids(item))
        match item.state:
            case ItemState.BUFFERED:
                self._admission.remove(item)
                item.done()
                self._held.forget(item)
            case ItemState.FINISHING | ItemState.DONE:
                pass  # its terminal delta is on the way; let it finish
            case ItemState.STARTING | ItemState.ORPHANED:  # ends at its next transition
                item.stop(LOST)
            case ItemState.RUNNING:
                item.stop(LOST)
                self._env.backend.abort(item.request_id)

    def end_running(self) -> None:
        """At the drain's deadline: abort what still runs. With a shared progress store
        each is handed over (silent, its offset uncommitted), so the partition's next owner
        resumes it as after a kill -9 and its client gets every token; with this process's
        own store nobody could resume it, and its client gets 'abort'."""
        hand_over = not self._env.progress.in_process
        for item in [i for i in self._held if i.state is ItemState.RUNNING]:
            logger.info(
                "request_id=%s tenant_id=%s %s by the drain after %s tokens",
                *ids(item),
                "handed over" if hand_over else "aborted",
                item.num_generated,
            )
            if hand_over:
                item.stop(HANDED_OVER)
            self._env.backend.abort(item.request_id)
