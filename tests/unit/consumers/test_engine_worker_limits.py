"""The worker on the real torch engine (tiny-llama, CPU): a request outside the engine's
limits (a seed past uint64, a token id past the vocabulary) ends alone with 'error'; the
requests beside it stream to the end and the worker stays healthy."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import GenerateRequest, SamplingSpec
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request

PROMPT = [1, 17, 42, 99, 7, 300, 12]


def request(request_id: str, prompt: list[int], **sampling: int) -> GenerateRequest:
    spec = SamplingSpec(temperature=1.0, max_tokens=12, ignore_eos=True, **sampling)
    return make_request(request_id, prompt=prompt).model_copy(update={"sampling": spec})


@pytest.mark.slow
def test_bad_requests_end_alone_with_error_beside_good_ones(tmp_path: Path) -> None:
    config = EngineConfig(
        block_size=16, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256
    )
    engine = TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=tmp_path)
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    worker = WorkerThread(bus, engine).start()
    client.send(
        request("good", PROMPT, seed=2**63 - 1),
        request("seed", PROMPT, seed=2**64),
        request("token", [*PROMPT, 512]),
        request("negative-seed", PROMPT, seed=-(2**63)),
    )
    client.wait_finished(["good", "seed", "token", "negative-seed"], timeout_s=60)
    assert worker.worker.stats.healthy and engine.health()
    worker.stop()

    streams = client.view.streams
    for rid in ("good", "negative-seed"):
        assert streams[rid].finish_reason == "length" and len(streams[rid].token_ids) == 12
    for rid, message in (("seed", "seed must be in"), ("token", "token id 512")):
        assert streams[rid].finish_reason == "error" and streams[rid].token_ids == []
        assert message in (streams[rid].deltas[-1].error or "")
