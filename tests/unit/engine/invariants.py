"""Invariant checks shared by the block-pool and scheduler tests (docs/architecture.md §7, §9)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.engine.core.outputs import SchedulerOutput
from sluice.engine.core.request import RequestStatus
from sluice.engine.core.scheduler import Scheduler

if TYPE_CHECKING:
    from sluice.engine.backends.base import EngineDelta, EngineRequest
    from sluice.engine.engine_core import EngineCore


def check_pool_and_tables(scheduler: Scheduler) -> None:
    """Ref counts equal table memberships; free list = blocks nobody holds; no dup in a table."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    running_ids = {r.request_id for r in scheduler.running}
    assert kv.num_requests() == len(running_ids), "a block table outlived its request"
    holders: Counter[int] = Counter()
    for request in scheduler.running:
        blocks = kv.get_blocks(request.request_id)
        ids = [b.block_id for b in blocks]
        assert ids == kv.get_block_ids(request.request_id)
        assert len(set(ids)) == len(ids), "a block appears twice in one table"
        assert 0 not in ids, "the null block was handed out"
        holders.update(ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"ref_cnt of block {block.block_id}"
        assert (block.ref_cnt == 0) == pool.is_free(block)
        if holders[block.block_id] > 1:
            assert block.block_hash is not None, "two tables share a block that is not cached"
    assert pool.null_block.ref_cnt == 1
    assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """The token budget and the sequence cap hold; one entry per scheduled request."""
    total = sum(s.num_new_tokens for s in output.scheduled)
    assert total == output.num_batched_tokens
    assert total <= scheduler.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.max_num_seqs
    ids = [s.request_id for s in output.scheduled]
    assert len(set(ids)) == len(ids)
    for scheduled in output.scheduled:
        request = scheduled.request
        assert request.status == RequestStatus.RUNNING
        assert scheduled.num_new_tokens > 0
        end = scheduled.num_computed_tokens_before + scheduled.num_new_tokens
        assert end <= request.num_tokens
        assert scheduled.sample == (end == request.num_tokens)
        assert len(scheduled.block_ids) * scheduler.block_size >= end
        threshold = scheduler.long_prefill_token_threshold
        if threshold:
            assert scheduled.num_new_tokens <= threshold


def check_all_returned(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert scheduler.kv_cache_manager.num_requests() == 0


def drive(
    core: EngineCore, requests: Sequence[EngineRequest] = (), max_steps: int = 5000
) -> dict[str, list[EngineDelta]]:
    """Add `requests`, step `core` until nothing is unfinished, and check every block came
    back; each request's deltas, in order."""
    for request in requests:
        core.add_request(request)
    out: dict[str, list[EngineDelta]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for delta in core.step():
            out.setdefault(delta.request_id, []).append(delta)
    assert not core.has_unfinished()
    check_all_returned(core.scheduler)
    return out


def outcomes(out: dict[str, list[EngineDelta]]) -> dict[str, tuple[list[int], str, str | None]]:
    """Each request's tokens, text and finish reason from its deltas."""
    return {
        rid: (
            [t for d in ds for t in d.token_ids],
            "".join(d.text for d in ds),
            ds[-1].finish_reason,
        )
        for rid, ds in out.items()
    }
