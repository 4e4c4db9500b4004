"""The worker on the real torch engine (tiny-llama, CPU): streams, usage, and a failover
whose resumed attempt continues the uninterrupted greedy output token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import GenerateRequest, SamplingSpec
from sluice.consumers.progress import MemoryProgressStore
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request

PROMPT = [1, 17, 42, 99, 7, 300, 12]
# long enough that the worker is abandoned mid-stream however the threads are scheduled
# (the engine thread runs ahead of this test's thread between two checks)
MAX_TOKENS = 240


def backend(data_dir: Path) -> TorchEngineBackend:
    config = EngineConfig(
        block_size=16, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256
    )
    return TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=data_dir)


def request(request_id: str) -> GenerateRequest:
    spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return make_request(request_id, prompt=PROMPT, max_tokens=MAX_TOKENS).model_copy(
        update={"sampling": spec}
    )


@pytest.mark.slow
def test_tiny_llama_streams_and_resumes_after_a_worker_dies(tmp_path: Path) -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    store = MemoryProgressStore()
    engine_a = backend(tmp_path)
    a = WorkerThread(bus, engine_a, progress=store, worker_id="a").start()
    client.send(request("ref"))
    client.wait_finished(["ref"], timeout_s=60)
    # the engine runs at a lower priority (EngineOptions.thread_nice); the backend
    # applies it when torch has one thread (test_torch_backend)
    assert engine_a.options.thread_nice == 10
    client.send(request("fo"))
    client.wait(lambda: len(client.view.streams.get("fo", _NONE).token_ids) >= 10, 60)
    a.abandon()
    b = WorkerThread(bus, backend(tmp_path), progress=store, worker_id="b").start()
    client.wait_finished(["fo"], timeout_s=60)
    b.stop()

    ref, fo = client.view.streams["ref"], client.view.streams["fo"]
    assert len(ref.token_ids) == MAX_TOKENS and ref.finish_reason == "length"
    assert fo.token_ids == ref.token_ids and fo.attempt == 1
    assert fo.text == ref.text
    usage = {(u.request_id, u.attempt): u for u in client.usage}
    assert usage[("ref", 0)].completion_tokens == MAX_TOKENS
    assert usage[("ref", 0)].prompt_tokens == len(PROMPT)
    assert 0 < usage[("fo", 1)].completion_tokens < MAX_TOKENS


class _Stream:
    token_ids: list[int] = []


_NONE = _Stream()
