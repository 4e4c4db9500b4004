"""The gateway's word from the workers on whether an engine is up (`api.engine_verdict`):
set by a delta marked unavailable, cleared by output; while it stands a call's first
delta decides whether it is refused before its answer starts. Each model pool is judged
apart."""

from __future__ import annotations

import asyncio

from sluice.api.engine_verdict import EngineVerdict
from sluice.bus.messages import ENGINE_UNAVAILABLE, TokenDelta

POOL = "tiny"
OTHER = "other-model"
DOWN = "no engine is up: the upstream server at http://h:1 does not answer its health check"


def _unavailable(request_id: str) -> TokenDelta:
    return TokenDelta(
        request_id=request_id,
        seq_no=0,
        finish_reason="error",
        error=DOWN,
        error_code=ENGINE_UNAVAILABLE,
    )


def _token(request_id: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, seq_no=0, token_ids=[7], text="x")


def test_nothing_waits_until_a_worker_said_no_engine_is_up() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        assert verdict.watch("a", POOL) is None
        verdict.heard(_token("a"), POOL)
        assert verdict.down == {} and verdict.watch("b", POOL) is None
        verdict.heard(_unavailable("b"), POOL)
        assert verdict.down == {POOL: DOWN}

    asyncio.run(run())


def test_a_call_whose_first_delta_says_so_too_is_refused_with_the_workers_message() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        verdict.heard(_unavailable("earlier"), POOL)
        waiter = verdict.watch("call", POOL)
        assert waiter is not None
        asyncio.get_running_loop().call_soon(verdict.heard, _unavailable("call"), POOL)
        assert await verdict.refusal("call", waiter) == DOWN

    asyncio.run(run())


def test_output_clears_the_verdict_and_its_call_goes_on() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        verdict.heard(_unavailable("earlier"), POOL)
        waiter = verdict.watch("call", POOL)
        assert waiter is not None
        asyncio.get_running_loop().call_soon(verdict.heard, _token("call"), POOL)
        assert await verdict.refusal("call", waiter) is None
        assert verdict.down == {} and verdict.watch("next", POOL) is None

    asyncio.run(run())


def test_a_first_delta_that_does_not_come_within_the_hold_lets_the_answer_start() -> None:
    async def run() -> None:
        verdict = EngineVerdict(hold_s=0.01)
        verdict.heard(_unavailable("earlier"), POOL)
        waiter = verdict.watch("call", POOL)
        assert waiter is not None
        assert await verdict.refusal("call", waiter) is None
        verdict.heard(_unavailable("call"), POOL)  # too late: nobody waits for it any more
        assert waiter.cancelled()

    asyncio.run(run())


def test_one_pool_down_does_not_hold_another_pools_calls() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        verdict.heard(_unavailable("earlier"), POOL)
        assert verdict.watch("elsewhere", OTHER) is None  # its call is published at once
        assert verdict.watch("here", POOL) is not None
        verdict.heard(_token("elsewhere"), OTHER)  # the other pool's output clears nothing here
        assert verdict.down == {POOL: DOWN}
        verdict.heard(_unavailable("o"), OTHER)
        verdict.heard(_token("here"), POOL)
        assert verdict.down == {OTHER: DOWN}

    asyncio.run(run())


def test_a_delta_of_no_call_of_this_gateway_judges_no_pool() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        verdict.heard(_unavailable("earlier"), POOL)
        waiter = verdict.watch("call", POOL)
        assert waiter is not None
        verdict.heard(_unavailable("stray"), None)
        verdict.heard(_token("call"), None)  # its track already gone: no pool to clear
        assert verdict.down == {POOL: DOWN}
        assert await verdict.refusal("call", waiter) is None

    asyncio.run(run())
