"""`ProcessEngineBackend.restart`: after a kill -9 the requests it held end with a
retryable 'error', and a fresh engine process serves from a new delta stream."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from sluice.engine.backends.base import EngineDeadError, EngineDelta, EngineRequest
from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
from tests.unit.engine.test_process_backend import CONFIG, PROMPT, greedy

pytestmark = pytest.mark.slow  # each start imports torch in a new interpreter


async def read_all(engine: ProcessEngineBackend, kill_at_first_token: bool) -> list[EngineDelta]:
    """Every delta until the stream ends or all it carried ended; kill -9 on the first token."""
    out: list[EngineDelta] = []
    live: set[str] = set()
    async with asyncio.timeout(60):
        async for batch in engine.deltas():
            out += batch
            live |= {d.request_id for d in batch}
            live -= {d.request_id for d in batch if d.finished}
            if kill_at_first_token and any(d.token_ids for d in batch):
                kill_at_first_token = False
                assert engine.pid is not None
                os.kill(engine.pid, signal.SIGKILL)
            elif not live and not kill_at_first_token:
                return out
    return out


def test_a_killed_engine_process_ends_its_requests_retryable_and_restarts(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        engine = ProcessEngineBackend(EngineSpec("tiny-llama", CONFIG, tmp_path))
        engine.start()
        engine.submit(EngineRequest("a", PROMPT, greedy(200)))
        engine.submit(EngineRequest("b", PROMPT, greedy(200)))
        died = await read_all(engine, kill_at_first_token=True)
        ends = {d.request_id: d for d in died if d.finished}
        assert set(ends) == {"a", "b"}
        assert all(d.finish_reason == "error" and d.retryable for d in ends.values())
        assert not engine.health()
        with pytest.raises(EngineDeadError):
            engine.submit(EngineRequest("while-dead", PROMPT, greedy(4)))

        await asyncio.to_thread(engine.restart, asyncio.get_running_loop())
        assert engine.health() and engine.vocab_size == 512
        engine.submit(EngineRequest("c", PROMPT, greedy(16)))
        again = await read_all(engine, kill_at_first_token=False)
        assert [d.finish_reason for d in again if d.finished] == ["length"]
        assert sum(len(d.token_ids) for d in again) == 16

        await asyncio.to_thread(engine.shutdown, 10.0)
        with pytest.raises(EngineDeadError):
            engine.restart()

    asyncio.run(main())
