"""The gateway's word from the workers on whether an engine is up (`api.engine_verdict`):
set by a delta marked unavailable, cleared by output; while it stands a call's first
delta decides whether it is refused before its answer starts."""

from __future__ import annotations

import asyncio

from sluice.api.engine_verdict import EngineVerdict
from sluice.bus.messages import ENGINE_UNAVAILABLE, TokenDelta

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
        assert verdict.watch("a") is None
        verdict.heard(_token("a"))
        assert verdict.down is None and verdict.watch("b") is None
        verdict.heard(_unavailable("b"))
        assert verdict.down == DOWN

    asyncio.run(run())


def test_a_call_whose_first_delta_says_so_too_is_refused_with_the_workers_message() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        verdict.heard(_unavailable("earlier"))
        waiter = verdict.watch("call")
        assert waiter is not None
        asyncio.get_running_loop().call_soon(verdict.heard, _unavailable("call"))
        assert await verdict.refusal("call", waiter) == DOWN

    asyncio.run(run())


def test_output_clears_the_verdict_and_its_call_goes_on() -> None:
    async def run() -> None:
        verdict = EngineVerdict()
        verdict.heard(_unavailable("earlier"))
        waiter = verdict.watch("call")
        assert waiter is not None
        asyncio.get_running_loop().call_soon(verdict.heard, _token("call"))
        assert await verdict.refusal("call", waiter) is None
        assert verdict.down is None and verdict.watch("next") is None

    asyncio.run(run())


def test_a_first_delta_that_does_not_come_within_the_hold_lets_the_answer_start() -> None:
    async def run() -> None:
        verdict = EngineVerdict(hold_s=0.01)
        verdict.heard(_unavailable("earlier"))
        waiter = verdict.watch("call")
        assert waiter is not None
        assert await verdict.refusal("call", waiter) is None
        verdict.heard(_unavailable("call"))  # too late: nobody waits for it any more
        assert waiter.cancelled()

    asyncio.run(run())
