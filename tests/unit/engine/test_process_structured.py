"""A constrained request through the engine process: the child compiles the grammar from
the tokenizer it loaded, and the choice comes back whole, finished 'stop'."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.sampling import Constraint, SamplingParams

CONFIG = EngineConfig(block_size=16, max_model_len=256, num_kv_blocks=64, dtype="float32")
CHOICES = ["alpha", "beta gamma"]


def test_the_engine_process_honours_a_choice(tmp_path: Path) -> None:
    async def main() -> list[EngineDelta]:
        engine = ProcessEngineBackend(EngineSpec("tiny-llama", CONFIG, tmp_path))
        engine.start()
        try:
            params = SamplingParams(
                temperature=0.0, max_tokens=20, constraint=Constraint("choice", json.dumps(CHOICES))
            )
            engine.submit(EngineRequest("c", [0, 5, 6, 7], params))
            got: list[EngineDelta] = []
            async for batch in engine.deltas():
                got.extend(batch)
                if any(d.finished for d in batch):
                    return got
            return got
        finally:
            await asyncio.to_thread(engine.shutdown, 10.0)

    deltas = asyncio.run(main())
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) in CHOICES
