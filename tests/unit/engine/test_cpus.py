"""CPU layouts: parsing cpu lists, planning the engine's cores, pinning threads."""

from __future__ import annotations

import os
import threading

import pytest

from sluice.engine import cpus
from sluice.engine.cpus import CpuLayout, parse_cpus, plan_layout


def test_cpu_lists_parse_like_taskset_and_bad_ones_say_why() -> None:
    assert parse_cpus("1-3,5") == frozenset({1, 2, 3, 5})
    assert parse_cpus("0") == frozenset({0})
    assert parse_cpus(" 2 , 4-4") == frozenset({2, 4})
    for bad in ("", "a", "1-", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no cpu affinity here")
def test_a_layout_gives_the_engine_its_cores_and_leaves_the_rest_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpus, "available_cpus", lambda: frozenset(range(4)))
    assert plan_layout(None, 3) is None
    assert plan_layout("none", 3) is None
    assert plan_layout("auto", 3) == CpuLayout(frozenset({1, 2, 3}), frozenset({0}))
    assert plan_layout("auto", 1) == CpuLayout(frozenset({3}), frozenset({0, 1, 2}))
    assert plan_layout("0,2", 2) == CpuLayout(frozenset({0, 2}), frozenset({1, 3}))
    # cores this process may not use are dropped; nothing left for either side: no pinning
    assert plan_layout("2-9", 2) == CpuLayout(frozenset({2, 3}), frozenset({0, 1}))
    assert plan_layout("auto", 4) is None
    assert plan_layout("0-3", 1) is None
    assert plan_layout("7", 1) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no cpu affinity here")
def test_pinning_a_process_moves_every_thread_and_the_threads_they_start() -> None:
    everything = os.sched_getaffinity(0)
    one = frozenset([max(everything)])
    seen: dict[str, set[int]] = {}
    started, release = threading.Event(), threading.Event()

    def older() -> None:
        started.set()
        release.wait(5.0)
        seen["older"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=older)
    thread.start()
    started.wait(5.0)
    try:
        cpus.pin_process(one)
        release.set()
        thread.join(5.0)
        later = threading.Thread(target=lambda: seen.update(later=os.sched_getaffinity(0)))
        later.start()
        later.join(5.0)
        assert seen == {"older": one, "later": one}
        assert os.sched_getaffinity(0) == one
    finally:
        cpus.pin_process(frozenset(everything))
    assert os.sched_getaffinity(0) == everything
