"""Hypothesis: scheduler + KV bookkeeping invariants under random workloads.

Every step: Σ scheduled tokens <= budget, running <= max_num_seqs, ref counts equal table
memberships, no block in two tables unless it is a cached prefix block. At the end: every
block is back in the pool, and every request that ran to completion produced exactly the
tokens the fake model gives without any KV bookkeeping (chunking, prefix hits and
preemption change nothing).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.config import EngineConfig
from sluice.engine.core.request import Request, RequestStatus
from sluice.engine.core.scheduler import Scheduler
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.fakes import FakeRunner, reference_tokens
from tests.unit.engine.invariants import check_all_returned, check_pool_and_tables, check_step

_BLOCK_SIZE = 4

_request = st.tuples(
    st.lists(st.integers(1, 5), min_size=1, max_size=20),  # prompt; small alphabet: shared prefixes
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # priority
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 25)),  # abort at step
)


@settings(max_examples=120, deadline=None)
@given(
    requests=st.lists(_request, min_size=1, max_size=8),
    num_kv_blocks=st.integers(7, 24),
    max_num_batched_tokens=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    threshold=st.sampled_from([0, 3]),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
)
def test_random_workload_keeps_invariants_and_outputs(
    requests: list[tuple[list[int], int, int, int, int | None]],
    num_kv_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    threshold: int,
    policy: str,
    caching: bool,
) -> None:
    config = EngineConfig(
        block_size=_BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=24,
        long_prefill_token_threshold=threshold,
        scheduling_policy=policy,  # type: ignore[arg-type]
        enable_prefix_caching=caching,
    )
    scheduler = Scheduler(config, num_kv_blocks, hash_seed=0)
    runner = FakeRunner(num_kv_blocks, _BLOCK_SIZE)
    pending = sorted(enumerate(requests), key=lambda item: item[1][3])
    added: dict[str, Request] = {}
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1][3] <= step:
            i, (prompt, max_tokens, priority, _, _) = pending.pop(0)
            request = Request(
                f"r{i}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
                priority=priority,
                arrival_time=float(i),
            )
            scheduler.add_request(request)
            added[request.request_id] = request
        for i, (_, _, _, _, abort_at) in enumerate(requests):
            if abort_at == step:
                scheduler.abort_requests(f"r{i}")
        output = scheduler.schedule(now=0.0)
        check_step(scheduler, output)
        runner_output = runner.execute(output)
        scheduler.update_from_output(output, runner_output)
        check_pool_and_tables(scheduler)
        step += 1
        assert step < 2000, "no progress"
    check_all_returned(scheduler)
    for request_id, request in added.items():
        i = int(request_id[1:])
        prompt, max_tokens = requests[i][0], requests[i][1]
        expected = reference_tokens(prompt, max_tokens)
        assert request.output_token_ids == expected[: request.num_output_tokens]
        if request.status == RequestStatus.FINISHED_LENGTH:
            limit = min(max_tokens, config.max_model_len - len(prompt))
            # a request that outgrew the whole cache is cut short, still as length
            capacity_tokens = (num_kv_blocks - 1) * _BLOCK_SIZE + 1
            assert request.num_output_tokens == limit or request.num_tokens >= capacity_tokens
        else:
            assert request.status == RequestStatus.FINISHED_ABORTED
