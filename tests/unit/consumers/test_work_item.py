"""The work item's state machine: each transition leaves only its source states; end reasons."""

from __future__ import annotations

import pytest

from sluice.bus.base import TopicPartition
from sluice.consumers.progress import AttemptStart
from sluice.consumers.work_item import (
    ABORTED,
    DEADLINE,
    FENCED,
    FINISHED,
    LOST,
    EndKind,
    EndReason,
    IllegalTransition,
    ItemState,
    WorkItem,
)
from tests.unit.consumers.engine_harness import make_request


def _item() -> WorkItem:
    return WorkItem(make_request("r"), TopicPartition("t", 0), 0, None, 0)


def test_a_request_that_runs_goes_buffered_starting_running_finishing_done() -> None:
    item = _item()
    assert item.state is ItemState.BUFFERED
    item.start()
    item.begin(AttemptStart(attempt=2, token_ids=[5, 6], text_len=2))
    assert (item.attempt, item.token_offset, item.text_offset) == (2, 2, 2)
    item.run()
    assert item.state is ItemState.RUNNING and item.scheduled_ms is not None
    item.finishing()
    item.done()
    assert item.state is ItemState.DONE


def test_an_orphan_goes_back_to_the_buffer_or_is_answered() -> None:
    item = _item()
    item.start()
    item.run()
    item.orphan()
    item.requeue()
    assert item.state is ItemState.BUFFERED
    item.start()
    item.run()
    item.orphan()
    item.start()  # answered without running (cancelled while the engine restarted)
    item.finishing()
    assert item.state is ItemState.FINISHING


@pytest.mark.parametrize(
    ("steps", "illegal"),
    [
        ([], "run"),  # not started
        ([], "finishing"),
        ([], "orphan"),
        (["start", "run"], "start"),  # running: started already
        (["start", "run"], "requeue"),
        (["start", "run", "finishing"], "orphan"),
        (["start", "run", "finishing", "done"], "done"),  # released twice
        (["start", "run", "finishing", "done"], "start"),
    ],
)
def test_a_transition_from_a_state_it_does_not_leave_raises(steps: list[str], illegal: str) -> None:
    item = _item()
    for step in steps:
        getattr(item, step)()
    before = item.state
    with pytest.raises(IllegalTransition):
        getattr(item, illegal)()
    assert item.state is before


def test_begin_needs_a_starting_item() -> None:
    with pytest.raises(IllegalTransition):
        _item().begin(AttemptStart(attempt=0))


def test_the_first_end_reason_holds_and_a_silent_one_overrides_it() -> None:
    item = _item()
    item.stop(DEADLINE)
    item.stop(ABORTED)
    assert item.end is DEADLINE and not item.silent
    item.stop(LOST)
    assert item.end is LOST and item.silent
    item.stop(FENCED)
    item.stop(ABORTED)
    assert item.end is LOST


def test_end_reasons_map_to_finish_reasons() -> None:
    error = EndReason.error("bad sampling")
    assert (error.kind, error.finish_reason, error.detail) == (
        EndKind.ERROR,
        "error",
        "bad sampling",
    )
    assert [r.finish_reason for r in (ABORTED, DEADLINE, LOST, FENCED)] == [
        "abort",
        "deadline",
        "abort",
        "abort",
    ]
    with pytest.raises(ValueError):
        _ = FINISHED.finish_reason  # an earlier attempt answered: nothing to publish
