"""The ProgressStore contract, on the in-memory store and on real Redis alike."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluice.consumers.progress import (
    AttemptStart,
    MemoryProgressStore,
    ProgressStore,
    StepProgress,
    call,
)
from tests.integration.consumers.redis_progress import redis_progress_store


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[ProgressStore]:
    if request.param == "memory":
        yield MemoryProgressStore()
        return
    yield from redis_progress_store()


def test_first_attempt_then_progress_then_a_resume_with_a_higher_attempt(
    store: ProgressStore,
) -> None:
    [first] = store.begin_attempts([("r1", 0)])
    assert (first.attempt, first.token_ids, first.text_len, first.finished) == (0, [], 0, False)
    assert store.record([StepProgress("r1", 0, 0, [5, 6], 3)]) == set()
    assert store.record([StepProgress("r1", 0, 2, [7], 4)]) == set()
    [resumed] = store.begin_attempts([("r1", 0)])
    assert (resumed.attempt, resumed.token_ids, resumed.text_len) == (1, [5, 6, 7], 4)


def test_a_resume_names_the_attempt_it_supersedes_and_what_that_one_published(
    store: ProgressStore,
) -> None:
    """What a dead worker's attempt published, for its usage record (kill -9 sends none)."""
    [first] = store.begin_attempts([("s1", 0)])
    assert first.superseded is None
    store.record([StepProgress("s1", 0, 0, [5, 6, 7], 3)])
    [second] = store.begin_attempts([("s1", 0)])
    assert (second.attempt, second.superseded) == (1, (0, 3))
    [third] = store.begin_attempts([("s1", 0)])  # attempt 1 died before publishing
    assert (third.attempt, third.superseded) == (2, None)
    store.record([StepProgress("s1", 2, 3, [8, 9], 5)])
    [fourth] = store.begin_attempts([("s1", 0)])
    assert (fourth.attempt, fourth.superseded) == (3, (2, 2))
    store.record([StepProgress("s1", 3, 5, [1], 6, finished=True)])
    [done] = store.begin_attempts([("s1", 0)])
    # the attempt that finished it and what it published: its worker may have died
    # between recording the finish and publishing its usage
    assert done.finished and (done.attempt, done.superseded) == (3, (3, 1))
    [again] = store.begin_attempts([("s1", 0)])
    assert again == done


def test_a_lower_attempt_is_fenced_and_changes_nothing(store: ProgressStore) -> None:
    store.begin_attempts([("r2", 0)])
    store.record([StepProgress("r2", 0, 0, [1], 1)])
    store.begin_attempts([("r2", 0)])  # attempt 1 begins elsewhere
    fenced = store.record([StepProgress("r2", 0, 1, [2], 2), StepProgress("r3", 0, 0, [9], 1)])
    assert fenced == {"r2"}
    [state] = store.begin_attempts([("r2", 0)])
    assert (state.attempt, state.token_ids, state.text_len) == (2, [1], 1)


def test_replayed_writes_are_idempotent_and_gaps_are_refused(store: ProgressStore) -> None:
    store.begin_attempts([("r4", 0)])
    step = StepProgress("r4", 0, 0, [1, 2], 2)
    assert store.record([step, step]) == set()
    assert store.record([StepProgress("r4", 0, 5, [3], 3)]) == {"r4"}
    [state] = store.begin_attempts([("r4", 3)])
    assert (state.attempt, state.token_ids) == (3, [1, 2])  # min_attempt from the request


def test_a_finished_request_stays_finished(store: ProgressStore) -> None:
    store.begin_attempts([("r5", 0)])
    store.record([StepProgress("r5", 0, 0, [4], 1, finished=True)])
    [state] = store.begin_attempts([("r5", 0)])
    assert state.finished and state.attempt == 0 and state.token_ids == [4]


def test_concurrent_begins_hand_out_distinct_attempts(store: ProgressStore) -> None:
    attempts: list[int] = []
    lock = threading.Lock()

    def begin() -> None:
        for _ in range(10):
            [start] = store.begin_attempts([("race", 0)])
            with lock:
                attempts.append(start.attempt)

    threads = [threading.Thread(target=begin) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(attempts) == list(range(40))


def test_call_runs_an_in_process_store_on_the_loop_and_redis_on_the_io_thread(
    store: ProgressStore,
) -> None:
    threads: list[str] = []

    def begin(requests: list[tuple[str, int]]) -> list[AttemptStart]:
        threads.append(threading.current_thread().name)
        return store.begin_attempts(requests)

    with ThreadPoolExecutor(1, thread_name_prefix="progress-io") as io:
        [start] = asyncio.run(call(store, io, begin, [("c1", 0)]))
    assert start.attempt == 0
    assert threads[0].startswith("progress-io") is not store.in_process
