"""The `EngineBackend` contract as checks over a backend factory, run on every backend.

Each `check_*` takes a `ContractTarget` (how to build the backend, how to kill its
engine) and drives one backend through asyncio as the engine worker does: every request
gets exactly one terminal delta, aborts end a request running or waiting, an idle engine
does not step, bad prompts are refused at submit, a dead engine fails its requests and
turns unhealthy, shutdown aborts what is in flight. `test_backend_contract.py` runs them
on the torch thread backend (fake runner and tiny-llama) and on the sim backend.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pytest

from sluice.engine.backends.base import (
    EngineBackend,
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    RequestRejectedError,
)
from sluice.engine.sampling import SamplingParams
from tests.waiting import wait_until_async

PROMPT = list(range(1, 19))
KILL_MESSAGE = "device fell over"  # what `ContractTarget.kill` makes the engine raise


class MakeBackend(Protocol):
    def __call__(self, *, max_num_seqs: int = 64, max_model_len: int = 64) -> Any: ...


@dataclass(frozen=True)
class ContractTarget:
    """A backend under test. make: a fresh backend, not started, whose steps take a few
    milliseconds (so a test can act mid-stream) and whose vocabulary holds ids < 97;
    kill: make its engine loop raise RuntimeError(KILL_MESSAGE) at its next step."""

    name: str
    make: MakeBackend
    kill: Callable[[Any], None]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def collect(
    backend: EngineBackend,
    expected: set[str],
    on_batch: Callable[[list[EngineDelta]], Awaitable[None]] | None = None,
) -> dict[str, list[EngineDelta]]:
    """Read deltas until every expected request has its terminal delta."""
    out: dict[str, list[EngineDelta]] = {}
    done: set[str] = set()
    async with asyncio.timeout(20):
        async for batch in backend.deltas():
            assert len({d.request_id for d in batch}) == len(batch), "one delta per request/step"
            for delta in batch:
                assert delta.request_id not in done, "delta after the terminal one"
                out.setdefault(delta.request_id, []).append(delta)
                if delta.finished:
                    done.add(delta.request_id)
            if on_batch is not None:
                await on_batch(batch)
            if done >= expected:
                break
    return out


def output_tokens(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def check_every_request_gets_one_terminal_delta(target: ContractTarget) -> None:
    async def main() -> dict[str, list[EngineDelta]]:
        backend = target.make()
        backend.start()
        for i in range(6):
            backend.submit(EngineRequest(f"r{i}", PROMPT[: 5 + i], greedy(7)))
        out = await collect(backend, {f"r{i}" for i in range(6)})
        backend.shutdown()
        return out

    out = asyncio.run(main())
    for i in range(6):
        deltas = out[f"r{i}"]
        assert [d.finished for d in deltas].count(True) == 1
        assert len(output_tokens(deltas)) == 7
        last = deltas[-1]
        assert last.finish_reason == "length"
        assert (last.num_prompt_tokens, last.num_output_tokens) == (5 + i, 7)


def check_abort_mid_stream_ends_with_abort(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make()
        backend.start()
        backend.submit(EngineRequest("long", PROMPT, greedy(40)))

        async def abort_after_first(batch: list[EngineDelta]) -> None:
            if any(d.token_ids for d in batch):
                backend.abort("long")

        out = await collect(backend, {"long"}, abort_after_first)
        last = out["long"][-1]
        assert last.finish_reason == "abort"
        assert last.num_output_tokens is not None and 1 <= last.num_output_tokens < 40
        assert last.num_output_tokens == len(output_tokens(out["long"]))
        await wait_until_async(lambda: backend.stats().kv_usage == 0.0, 5.0, "blocks freed")
        backend.shutdown()

    asyncio.run(main())


def check_abort_while_waiting_gets_a_terminal_delta(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make(max_num_seqs=1)
        backend.start()
        backend.submit(EngineRequest("first", PROMPT, greedy(30)))
        backend.submit(EngineRequest("second", PROMPT, greedy(30)))
        backend.abort("second")
        backend.abort("never-submitted")
        out = await collect(backend, {"first", "second"})
        assert out["second"] == [
            EngineDelta(
                "second",
                finish_reason="abort",
                num_prompt_tokens=18,
                num_cached_tokens=0,
                num_output_tokens=0,
            )
        ]
        assert out["first"][-1].finish_reason == "length"
        backend.shutdown()

    asyncio.run(main())


def check_idle_engine_does_not_step_and_reports_stats(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make()
        assert not backend.health()  # not started yet
        backend.start()
        backend.submit(EngineRequest("a", PROMPT, greedy(3)))
        await collect(backend, {"a"})
        # stats are published after the step that delivered the deltas
        await wait_until_async(lambda: backend.stats().num_running == 0, 5.0, "an idle engine")
        steps = backend.stats().num_steps
        await asyncio.sleep(0.1)  # a window to watch it idle: the behaviour, not a wait
        stats = backend.stats()
        assert stats.num_steps == steps
        assert (stats.num_waiting, stats.num_running, stats.kv_usage) == (0, 0, 0.0)
        assert stats.num_generated_tokens == 3 and stats.num_prompt_tokens == 18
        assert stats.num_kv_blocks > 0
        assert backend.health()
        backend.shutdown()
        assert not backend.health()

    asyncio.run(main())


def check_rejects_bad_prompts_at_submit_and_ignores_duplicates(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make(max_model_len=8)
        backend.start()
        for prompt in ([1] * 8, [], [1, 10**6], [-1]):
            with pytest.raises(RequestRejectedError):
                backend.submit(EngineRequest("bad", prompt, greedy(2)))
        backend.submit(EngineRequest("a", [1, 2], greedy(5)))
        backend.submit(EngineRequest("a", [1, 2], greedy(5)))
        out = await collect(backend, {"a"})
        assert sum(d.finished for d in out["a"]) == 1
        assert len(output_tokens(out["a"])) == 5
        assert "bad" not in out
        backend.shutdown()

    asyncio.run(main())


def check_deadline_passed_ends_with_deadline(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make()
        backend.start()
        late = EngineRequest("late", PROMPT, greedy(5), deadline=time.monotonic() - 1.0)
        backend.submit(late)
        backend.submit(EngineRequest("on-time", PROMPT, greedy(5)))
        out = await collect(backend, {"late", "on-time"})
        assert out["late"][-1].finish_reason == "deadline"
        assert out["late"][-1].num_output_tokens == 0
        assert out["on-time"][-1].finish_reason == "length"
        backend.shutdown()

    asyncio.run(main())


def check_dead_engine_fails_in_flight_requests(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make()
        backend.start()
        backend.submit(EngineRequest("a", PROMPT, greedy(40)))
        backend.submit(EngineRequest("b", [1, 2], greedy(40)))
        out: dict[str, list[EngineDelta]] = {}
        killed = False
        async with asyncio.timeout(20):
            async for batch in backend.deltas():  # ends after the engine died
                for delta in batch:
                    out.setdefault(delta.request_id, []).append(delta)
                if not killed and any(d.token_ids for d in batch):
                    target.kill(backend)
                    killed = True
        for request_id in ("a", "b"):
            last = out[request_id][-1]
            assert [d.finished for d in out[request_id]].count(True) == 1
            assert last.finish_reason == "error" and last.retryable
            assert KILL_MESSAGE in (last.error or "")
        assert not backend.health()
        with pytest.raises(EngineDeadError):
            backend.submit(EngineRequest("c", [1], greedy(1)))
        backend.shutdown()  # after death: returns, changes nothing

    asyncio.run(main())


def check_shutdown_aborts_in_flight_requests(target: ContractTarget) -> None:
    async def main() -> None:
        backend = target.make(max_num_seqs=1)
        backend.start()
        backend.submit(EngineRequest("a", PROMPT, greedy(40)))
        backend.submit(EngineRequest("b", PROMPT, greedy(10)))
        seen: list[EngineDelta] = []
        async with asyncio.timeout(20):
            async for batch in backend.deltas():
                seen.extend(batch)
                if len(seen) >= 2:
                    break
        backend.shutdown()
        async with asyncio.timeout(20):
            async for batch in backend.deltas():
                seen.extend(batch)
        terminal = {d.request_id: d.finish_reason for d in seen if d.finished}
        assert terminal == {"a": "abort", "b": "abort"}
        assert not backend.health()
        with pytest.raises(EngineDeadError):
            backend.submit(EngineRequest("c", [1], greedy(1)))

    asyncio.run(main())


def check_submit_from_other_threads(target: ContractTarget) -> None:
    """Submits and aborts from a thread that is not the loop's all take effect."""

    async def main() -> None:
        backend = target.make()
        backend.start()
        ids = [f"r{i}" for i in range(100)]

        def submit_all() -> None:
            for request_id in ids:
                backend.submit(EngineRequest(request_id, [1, 2, 3], greedy(2)))
            backend.abort("r99")

        thread = threading.Thread(target=submit_all)
        thread.start()
        out = await collect(backend, set(ids))
        thread.join(10)
        assert all(out[i][-1].finish_reason == "length" for i in ids[:99])
        assert out["r99"][-1].finish_reason in ("abort", "length")  # raced its own steps
        backend.shutdown()

    asyncio.run(main())


CHECKS = [
    check_every_request_gets_one_terminal_delta,
    check_abort_mid_stream_ends_with_abort,
    check_abort_while_waiting_gets_a_terminal_delta,
    check_idle_engine_does_not_step_and_reports_stats,
    check_rejects_bad_prompts_at_submit_and_ignores_duplicates,
    check_deadline_passed_ends_with_deadline,
    check_dead_engine_fails_in_flight_requests,
    check_shutdown_aborts_in_flight_requests,
    check_submit_from_other_threads,
]
