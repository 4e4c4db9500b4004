"""Two engine processes behind one backend (tiny-llama, CPU): requests spread between
them with the tokens one engine gives, aborts reach the right one, and a kill -9 of one
ends only its requests (retryable) while the other's come through the restart."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.backends.base import (
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    EngineStats,
    RequestRejectedError,
)
from sluice.engine.backends.process_backend import EngineSpec
from sluice.engine.backends.replicated import ReplicatedBackend, replica_specs
from sluice.engine.config import EngineConfig
from tests.unit.engine.test_backend_contract import _kill_torch, make_replicated
from tests.unit.engine.test_process_backend import CONFIG, PROMPT, greedy, tokens, until_terminal

FAKE_PROMPT = [1, 2, 3]  # the fake runner's vocabulary holds ids < 97
slow = pytest.mark.slow  # each replica starts an interpreter that imports torch


def test_replica_specs_split_the_kv_cache(tmp_path: Path) -> None:
    spec = EngineSpec("tiny-llama", EngineConfig(kv_cache_mb=256.0), tmp_path)
    specs = replica_specs(spec, 2)
    assert [s.config.kv_cache_mb for s in specs] == [128.0, 128.0]
    assert all(s.model == "tiny-llama" and s.config.max_model_len == 2048 for s in specs)


def test_one_dead_replica_ends_its_requests_and_the_stream_the_other_goes_on() -> None:
    async def main() -> None:
        engine = make_replicated()
        engine.start()
        engine.submit(EngineRequest("a", FAKE_PROMPT, greedy(40)))  # replica 0
        engine.submit(EngineRequest("b", FAKE_PROMPT, greedy(40)))  # replica 1
        got: list[EngineDelta] = []
        async with asyncio.timeout(20):
            async for batch in engine.deltas():  # ends at the death
                got += batch
                if len(got) == 1:
                    _kill_torch(engine.replicas[0])  # type: ignore[arg-type]
        ends = {d.request_id: d for d in got if d.finished}
        assert ends["a"].finish_reason == "error" and ends["a"].retryable
        assert "b" not in ends
        assert not engine.health() and engine.error is not None
        engine.submit(EngineRequest("c", FAKE_PROMPT, greedy(5)))  # to the live replica
        more: dict[str, list[EngineDelta]] = {}
        await until_terminal(engine.deltas(), {"b", "c"}, more)
        b = [d for d in got if d.request_id == "b"] + more["b"]
        assert len(tokens(b)) == 40 and b[-1].finish_reason == "length"
        assert more["c"][-1].finish_reason == "length"
        with pytest.raises(EngineDeadError, match="cannot start again"):
            await asyncio.to_thread(engine.restart, asyncio.get_running_loop())
        engine.shutdown()
        async with asyncio.timeout(20):
            async for _ in engine.deltas():  # ends once the live replica stopped
                pass
        with pytest.raises(EngineDeadError):
            engine.submit(EngineRequest("d", FAKE_PROMPT, greedy(5)))

    asyncio.run(main())


class Scripted:
    """A replica the test drives: it posts what the test says, dies and restarts."""

    def __init__(self) -> None:
        self.config = EngineConfig()
        self.vocab_size: int | None = 97
        self.channel: Any = None
        self.up = False
        self.submitted: list[str] = []
        self.on_restart: Callable[[], None] = lambda: None

    def attach(self, channel: Any) -> None:
        self.channel = channel

    def start(self, loop: Any = None) -> None:
        self.up = True

    def restart(self, loop: Any = None) -> None:
        self.on_restart()
        self.up = True

    def die(self, *request_ids: str) -> None:
        self.up = False
        ends = [EngineDelta(r, finish_reason="error", retryable=True) for r in request_ids]
        self.channel.post(ends)
        self.channel.post(None)

    def submit(self, request: EngineRequest) -> None:
        self.submitted.append(request.request_id)

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.up:
            self.up = False
            self.channel.post(None)

    def health(self) -> bool:
        return self.up

    def stats(self) -> EngineStats:
        return EngineStats(num_kv_blocks=10)


def started_pair() -> tuple[ReplicatedBackend, Scripted, Scripted]:
    a, b = Scripted(), Scripted()
    engine = ReplicatedBackend([a, b])
    engine.start()
    return engine, a, b


async def shut_down(engine: ReplicatedBackend) -> None:
    """Shut `engine` down; its stream then ends with nothing more."""
    engine.shutdown()
    assert await read_stream(engine) == []


async def read_stream(engine: ReplicatedBackend) -> list[str]:
    """The request ids of one `deltas()` stream, until it ends."""
    async with asyncio.timeout(5):
        return [d.request_id async for batch in engine.deltas() for d in batch]


def test_a_replica_that_dies_during_a_restart_ends_the_stream_again() -> None:
    async def main() -> None:
        engine, a, b = started_pair()
        for rid in ("r0", "r1", "r2", "r3"):
            engine.submit(EngineRequest(rid, FAKE_PROMPT, greedy(5)))
        assert (a.submitted, b.submitted) == (["r0", "r2"], ["r1", "r3"])
        a.die("r0", "r2")
        assert await read_stream(engine) == ["r0", "r2"]
        b.on_restart = lambda: None
        a.on_restart = lambda: b.die("r1", "r3")  # b dies while a starts again
        engine.restart()
        assert not engine.health()
        assert await read_stream(engine) == ["r1", "r3"]  # then the stream ends again
        engine.restart()  # b alone
        assert engine.health()
        engine.submit(EngineRequest("r4", FAKE_PROMPT, greedy(5)))
        assert "r4" in a.submitted + b.submitted
        await shut_down(engine)

    asyncio.run(main())


def test_replicas_that_die_together_each_end_the_stream_after_their_requests() -> None:
    async def main() -> None:
        engine, a, b = started_pair()
        for rid in ("r0", "r1"):
            engine.submit(EngineRequest(rid, FAKE_PROMPT, greedy(5)))
        a.die("r0")
        b.die("r1")  # its requests' ends come after the end a's death made
        assert await read_stream(engine) == ["r0"]
        engine.restart()  # both
        assert await read_stream(engine) == ["r1"]  # ended again after them
        engine.restart()  # nothing left to start
        assert engine.health()
        await shut_down(engine)

    asyncio.run(main())


def test_shutdown_ends_the_stream_when_every_replica_was_down() -> None:
    async def main() -> None:
        engine, a, b = started_pair()
        a.die()
        b.die()
        assert await read_stream(engine) == []  # the first death's end
        engine.shutdown()
        assert await read_stream(engine) == []  # and shutdown's

    asyncio.run(main())


@contextlib.contextmanager
def two_processes(tmp_path: Path) -> Iterator[ReplicatedBackend]:
    """Two tiny-llama engine processes behind one backend, started; shut down after."""
    engine = ReplicatedBackend.of(EngineSpec("tiny-llama", CONFIG, tmp_path), 2)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@slow
def test_replicas_share_the_requests_and_stream_what_one_engine_does(tmp_path: Path) -> None:
    async def main() -> None:
        with two_processes(tmp_path) as engine:
            assert engine.health() and engine.vocab_size == 512
            assert len(set(engine.pids)) == 2 and None not in engine.pids
            with pytest.raises(RequestRejectedError):  # checked before it goes anywhere
                engine.submit(EngineRequest("long-prompt", list(range(1, 300)), greedy(4)))
            stream = engine.deltas()
            got: dict[str, list[EngineDelta]] = {}
            for rid in ("a", "b", "c", "d"):
                engine.submit(EngineRequest(rid, PROMPT, greedy(24)))
            engine.submit(EngineRequest("cut", PROMPT, greedy(200)))
            await until_terminal(
                stream, {"a", "b", "c", "d", "cut"}, got, lambda d: engine.abort("cut")
            )
            # the same greedy tokens from either replica
            assert len({tuple(tokens(got[r])) for r in "abcd"}) == 1
            assert all(len(tokens(got[r])) == 24 for r in "abcd")
            assert got["cut"][-1].finish_reason == "abort"
            # both engines worked: each ran steps and generated tokens
            parts = [r.stats() for r in engine.replicas]
            assert all(p.num_generated_tokens > 0 for p in parts)
            total = engine.stats()
            assert total.num_generated_tokens == sum(p.num_generated_tokens for p in parts)
            assert total.num_kv_blocks == sum(p.num_kv_blocks for p in parts)
        assert not engine.health()

    asyncio.run(main())


@slow
def test_a_killed_replica_ends_its_own_requests_and_restarts_alone(tmp_path: Path) -> None:
    async def main() -> None:
        with two_processes(tmp_path) as engine:
            survivor_pid = engine.pids[1]
            engine.submit(EngineRequest("a", PROMPT, greedy(200)))  # replica 0
            engine.submit(EngineRequest("b", PROMPT, greedy(200)))  # replica 1
            got: list[EngineDelta] = []
            killed = False
            async with asyncio.timeout(60):
                async for batch in engine.deltas():  # ends once, at the death
                    got += batch
                    if not killed and any(d.token_ids for d in batch):
                        killed = True
                        pid = engine.pids[0]
                        assert pid is not None
                        os.kill(pid, signal.SIGKILL)
            ends = {d.request_id: d for d in got if d.finished}
            assert ends["a"].finish_reason == "error" and ends["a"].retryable
            assert not engine.health() and "exited" in (engine.error or "")

            await asyncio.to_thread(engine.restart, asyncio.get_running_loop())
            assert engine.health() and engine.pids[1] == survivor_pid
            engine.submit(EngineRequest("c", PROMPT, greedy(16)))
            want = {"b", "c"} - set(ends)
            more: dict[str, list[EngineDelta]] = {}
            await until_terminal(engine.deltas(), want, more)
            b = [d for d in got if d.request_id == "b"] + more.get("b", [])
            assert len(tokens(b)) == 200 and b[-1].finish_reason == "length"
            assert len(tokens(more["c"])) == 16

    asyncio.run(main())
