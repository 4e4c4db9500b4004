"""Scheduler behaviour users rely on: prefix hits, preemption, priorities, deadlines, aborts."""

from __future__ import annotations

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.core.outputs import SchedulerOutput
from sluice.engine.core.request import Request, RequestStatus
from sluice.engine.core.scheduler import RequestRejectedError, Scheduler
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.fakes import FakeRunner, reference_tokens
from tests.unit.engine.invariants import check_all_returned, check_pool_and_tables, check_step


def make(
    num_kv_blocks: int = 32, block_size: int = 4, **overrides: object
) -> tuple[Scheduler, FakeRunner]:
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=overrides.pop("max_num_batched_tokens", 64),  # type: ignore[arg-type]
        max_model_len=overrides.pop("max_model_len", 64),  # type: ignore[arg-type]
        **overrides,  # type: ignore[arg-type]
    )
    return Scheduler(config, num_kv_blocks, hash_seed=0), FakeRunner(num_kv_blocks, block_size)


def req(request_id: str, prompt: list[int], max_tokens: int = 4, **kwargs: object) -> Request:
    params = kwargs.pop("params", None) or SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(request_id, prompt, params, **kwargs)  # type: ignore[arg-type]


def step(scheduler: Scheduler, runner: FakeRunner, now: float = 0.0) -> SchedulerOutput:
    output = scheduler.schedule(now=now)
    check_step(scheduler, output)
    scheduler.update_from_output(output, runner.execute(output))
    check_pool_and_tables(scheduler)
    return output


def run_all(scheduler: Scheduler, runner: FakeRunner) -> None:
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler, runner)
    raise AssertionError("did not finish")


PROMPT = list(range(1, 19))  # 18 tokens: 4 full blocks of 4 + 2


def test_second_request_hits_prefix_cache_and_outputs_match() -> None:
    scheduler, runner = make()
    first = req("a", PROMPT)
    scheduler.add_request(first)
    run_all(scheduler, runner)
    second = req("b", PROMPT)
    scheduler.add_request(second)
    output = step(scheduler, runner)
    assert second.num_cached_tokens == 16
    assert output.scheduled[0].num_computed_tokens_before == 16
    assert output.scheduled[0].num_new_tokens == 2
    run_all(scheduler, runner)
    assert first.num_cached_tokens == 0
    assert first.output_token_ids == second.output_token_ids == reference_tokens(PROMPT, 4)
    check_all_returned(scheduler)


def test_prefix_hit_never_covers_last_prompt_token() -> None:
    scheduler, runner = make()
    prompt = list(range(1, 17))  # exactly 4 blocks
    scheduler.add_request(req("a", prompt))
    run_all(scheduler, runner)
    second = req("b", prompt)
    scheduler.add_request(second)
    output = step(scheduler, runner)
    assert second.num_cached_tokens == 12
    assert output.scheduled[0].num_new_tokens == 4


def test_cache_salt_keeps_tenants_apart() -> None:
    scheduler, runner = make()
    scheduler.add_request(req("a", PROMPT, cache_salt="tenant-1"))
    run_all(scheduler, runner)
    other = req("b", PROMPT, cache_salt="tenant-2")
    same = req("c", PROMPT, cache_salt="tenant-1")
    scheduler.add_request(other)
    scheduler.add_request(same)
    step(scheduler, runner)
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 16


def test_prefix_caching_off_never_hits() -> None:
    scheduler, runner = make(enable_prefix_caching=False)
    scheduler.add_request(req("a", PROMPT))
    run_all(scheduler, runner)
    second = req("b", PROMPT)
    scheduler.add_request(second)
    run_all(scheduler, runner)
    assert second.num_cached_tokens == 0
    assert second.output_token_ids == reference_tokens(PROMPT, 4)


def test_chunked_prefill_respects_budget_and_threshold() -> None:
    scheduler, runner = make(max_num_batched_tokens=8, long_prefill_token_threshold=5)
    long = req("long", PROMPT)
    scheduler.add_request(long)
    chunks = [step(scheduler, runner).scheduled[0].num_new_tokens for _ in range(4)]
    assert chunks == [5, 5, 5, 3]
    assert long.num_output_tokens == 1
    run_all(scheduler, runner)
    assert long.output_token_ids == reference_tokens(PROMPT, 4)


def test_decode_and_prefill_share_one_budget() -> None:
    scheduler, runner = make(max_num_batched_tokens=6)
    scheduler.add_request(req("a", [1, 2, 3], max_tokens=8))
    step(scheduler, runner)
    scheduler.add_request(req("b", PROMPT))
    output = step(scheduler, runner)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 1), ("b", 5)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler, runner = make(
        max_num_batched_tokens=20, max_model_len=20, enable_chunked_prefill=False
    )
    scheduler.add_request(req("a", [1, 2, 3], max_tokens=8))
    scheduler.add_request(req("b", [4] * 18))
    output = step(scheduler, runner)
    assert [s.request_id for s in output.scheduled] == ["a"]  # b (18) > 20 - 3
    output = step(scheduler, runner)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 1), ("b", 18)]


def test_fcfs_preempts_latest_request_and_it_resumes_with_same_output() -> None:
    # 5 usable blocks of 4 tokens: two 8-token prompts fit, their decodes do not
    scheduler, runner = make(num_kv_blocks=6)
    first = req("a", [1] * 8, max_tokens=8)
    second = req("b", [2] * 8, max_tokens=8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted: list[str] = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        preempted += step(scheduler, runner).preempted_request_ids
    assert preempted and set(preempted) == {"b"}
    assert second.num_preemptions >= 1 and first.num_preemptions == 0
    assert first.output_token_ids == reference_tokens([1] * 8, 8)
    assert second.output_token_ids == reference_tokens([2] * 8, 8)
    check_all_returned(scheduler)


def test_priority_policy_serves_lower_value_first() -> None:
    scheduler, runner = make(max_num_seqs=1, scheduling_policy="priority")
    low = req("low", [1, 2], priority=5, arrival_time=1.0)
    high = req("high", [3, 4], priority=0, arrival_time=2.0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    output = step(scheduler, runner)
    assert [s.request_id for s in output.scheduled] == ["high"]


def test_priority_waiting_request_preempts_lower_running_one() -> None:
    scheduler, runner = make(max_num_seqs=1, scheduling_policy="priority")
    low = req("low", [1, 2], max_tokens=6, priority=5, arrival_time=1.0)
    scheduler.add_request(low)
    step(scheduler, runner)
    high = req("high", [3, 4], max_tokens=2, priority=0, arrival_time=2.0)
    scheduler.add_request(high)
    output = step(scheduler, runner)
    assert output.preempted_request_ids == ["low"]
    assert [s.request_id for s in output.scheduled] == ["high"]
    run_all(scheduler, runner)
    assert low.output_token_ids == reference_tokens([1, 2], 6)
    assert high.output_token_ids == reference_tokens([3, 4], 2)


def test_priority_preemption_under_kv_pressure_picks_lowest_priority() -> None:
    scheduler, runner = make(num_kv_blocks=6, scheduling_policy="priority")
    urgent = req("urgent", [1] * 8, max_tokens=8, priority=0, arrival_time=2.0)
    lazy = req("lazy", [2] * 8, max_tokens=8, priority=9, arrival_time=1.0)
    scheduler.add_request(lazy)
    scheduler.add_request(urgent)
    preempted: list[str] = []
    while scheduler.has_unfinished_requests():
        preempted += step(scheduler, runner).preempted_request_ids
    assert preempted and set(preempted) == {"lazy"}
    assert urgent.output_token_ids == reference_tokens([1] * 8, 8)
    assert lazy.output_token_ids == reference_tokens([2] * 8, 8)


def test_urgent_requests_cap_the_tokens_of_worse_ones_per_step() -> None:
    """Batch decodes (priority 2) share steps with an interactive request (priority 0):
    none in its prefill step, then at most priority_background_tokens per step, oldest
    first; the cap holds for priority_hold_s after the interactive request left, then
    lifts."""
    scheduler, runner = make(
        num_kv_blocks=64,
        scheduling_policy="priority",
        priority_background_tokens=3,
        priority_hold_s=1.0,
    )
    batch = [req(f"b{i}", [i + 1, 7], max_tokens=40, priority=2, arrival_time=i) for i in range(6)]
    for r in batch:
        scheduler.add_request(r)
    assert len(step(scheduler, runner, now=0.0).scheduled) == 6  # one priority: no cap
    urgent = req("u", [5] * 6, max_tokens=2, priority=0, arrival_time=10.0)
    scheduler.add_request(urgent)
    out = step(scheduler, runner, now=1.0)
    assert [s.request_id for s in out.scheduled] == ["u"]  # its prefill step: no batch
    out = step(scheduler, runner, now=1.05)
    assert [s.request_id for s in out.scheduled] == ["b0", "b1", "b2", "u"]  # 3 batch tokens
    while not urgent.is_finished:
        out = step(scheduler, runner, now=1.1)
        assert sum(s.num_new_tokens for s in out.scheduled if s.request_id != "u") <= 3
    assert len(step(scheduler, runner, now=1.5).scheduled) == 3  # held
    # a second urgent request right after a background-free step: the cap, not zero
    scheduler.add_request(req("u2", [4] * 6, max_tokens=1, priority=0, arrival_time=11.0))
    assert [s.request_id for s in step(scheduler, runner, now=1.6).scheduled] == ["u2"]
    scheduler.add_request(req("u3", [3] * 6, max_tokens=1, priority=0, arrival_time=12.0))
    ids = [s.request_id for s in step(scheduler, runner, now=1.7).scheduled]
    assert ids == ["b0", "b1", "b2", "u3"]  # never two background-free steps in a row
    assert len(step(scheduler, runner, now=2.8).scheduled) == 6  # lifted
    run_all(scheduler, runner)
    for i, r in enumerate(batch):
        assert r.output_token_ids == reference_tokens([i + 1, 7], 40)


def test_background_cap_off_with_fcfs_or_minus_one() -> None:
    for overrides in (
        {"scheduling_policy": "fcfs"},
        {"scheduling_policy": "priority", "priority_background_tokens": -1},
    ):
        scheduler, runner = make(num_kv_blocks=64, **overrides)
        for i in range(5):
            scheduler.add_request(req(f"b{i}", [i + 1], max_tokens=8, priority=2))
        step(scheduler, runner)
        scheduler.add_request(req("u", [9, 9], max_tokens=2, priority=0))
        assert len(step(scheduler, runner).scheduled) == 6


def test_deadline_expires_waiting_and_running_requests() -> None:
    scheduler, runner = make(max_num_seqs=1)
    running = req("run", [1, 2], max_tokens=10, deadline=5.0)
    waiting = req("wait", [3, 4], max_tokens=10, deadline=3.0)
    keeps = req("keep", [5, 6], max_tokens=2, deadline=100.0)
    for r in (running, waiting, keeps):
        scheduler.add_request(r)
    step(scheduler, runner, now=1.0)
    assert running.status == RequestStatus.RUNNING
    step(scheduler, runner, now=3.0)
    assert waiting.status == RequestStatus.FINISHED_DEADLINE
    output = step(scheduler, runner, now=5.0)
    assert running.status == RequestStatus.FINISHED_DEADLINE
    assert output.finished_request_ids == ["run"]  # "wait" was reported the step before
    assert [s.request_id for s in output.scheduled] == ["keep"]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, now=6.0)
    assert keeps.status == RequestStatus.FINISHED_LENGTH
    check_all_returned(scheduler)


def test_abort_waiting_and_running_frees_everything() -> None:
    scheduler, runner = make(max_num_seqs=1)
    running = req("run", PROMPT, max_tokens=10)
    waiting = req("wait", PROMPT, max_tokens=10)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    assert scheduler.abort_requests(["wait", "run", "unknown"]) == [waiting, running]
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.abort_requests("run") == []  # already finished: ignored
    assert not scheduler.has_unfinished_requests()
    check_all_returned(scheduler)
    output = scheduler.schedule(now=0.0)
    assert output.is_empty and output.finished_request_ids == ["wait", "run"]


def test_stop_checks_eos_stop_ids_min_tokens_and_length() -> None:
    scheduler, runner = make(max_model_len=12)
    expected = reference_tokens([1, 2, 3], 8)
    eos = req("eos", [1, 2, 3], max_tokens=8, eos_token_ids=(expected[2],))
    ignored = req(
        "ignored",
        [1, 2, 3],
        eos_token_ids=(expected[2],),
        params=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    )
    stop_id = req(
        "stop_id",
        [1, 2, 3],
        params=SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[expected[1]]),
    )
    min_tokens = req(
        "min",
        [1, 2, 3],
        eos_token_ids=(expected[0],),
        params=SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2),
    )
    model_len = req("model_len", [1, 2, 3], max_tokens=16)
    for r in (eos, ignored, stop_id, min_tokens, model_len):
        scheduler.add_request(r)
    run_all(scheduler, runner)
    assert eos.output_token_ids == expected[:3] and eos.status == RequestStatus.FINISHED_STOPPED
    assert ignored.num_output_tokens == 5 and ignored.status == RequestStatus.FINISHED_LENGTH
    assert stop_id.output_token_ids == expected[:2]
    assert stop_id.status == RequestStatus.FINISHED_STOPPED
    # the EOS at index 0 is ignored before min_tokens; it stops at the next EOS, if any
    again = [i for i in range(1, 8) if expected[i] == expected[0]]
    assert min_tokens.num_output_tokens == (again[0] + 1 if again else 8)
    assert model_len.num_tokens == 12 and model_len.status == RequestStatus.FINISHED_LENGTH


def test_request_that_outgrows_the_whole_cache_finishes_as_length() -> None:
    scheduler, runner = make(num_kv_blocks=3)  # 2 usable blocks = 8 tokens
    request = req("big", [1] * 6, max_tokens=20)
    scheduler.add_request(request)
    run_all(scheduler, runner)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 9  # 8 computed + the last sampled token
    check_all_returned(scheduler)


def test_rejects_prompts_that_cannot_run() -> None:
    scheduler, _ = make(max_model_len=8)
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        scheduler.add_request(req("long", [1] * 8))
    with pytest.raises(RequestRejectedError, match="empty"):
        scheduler.add_request(req("empty", []))
    scheduler.add_request(req("ok", [1] * 7))
    with pytest.raises(RequestRejectedError, match="already"):
        scheduler.add_request(req("ok", [1]))
