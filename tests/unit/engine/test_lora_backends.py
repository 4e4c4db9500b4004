"""LoRA adapters around the torch runner: slot residency, the scheduler's wait for a slot,
prefix hashes per adapter, the worker's conversion, and the other backends (sim accepts,
upstream names the adapter as its model, trtllm refuses, the engine process carries it)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.bus.base import TopicPartition
from sluice.bus.messages import AdapterRef, GenerateRequest
from sluice.consumers.work_item import WorkItem
from sluice.consumers.worker_requests import engine_request
from sluice.engine.backends.base import EngineDelta, EngineRequest, LoRARequest
from sluice.engine.backends.upstream_backend import completion_body
from sluice.engine.config import EngineConfig, EngineConfigError
from sluice.engine.core.hashing import BlockHasher
from sluice.engine.core.lora_slots import LoRASlots
from sluice.engine.core.request import Request, RequestStatus
from sluice.engine.core.scheduler import Scheduler
from sluice.engine.errors import RequestRejectedError
from sluice.engine.sampling import SamplingParams

A, B, C = (LoRARequest(n, f"/adapters/{n}") for n in "abc")


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# -- slots -----------------------------------------------------------------------------


def test_slots_evict_the_least_recently_used_adapter_no_request_holds() -> None:
    slots = LoRASlots(2)
    assert slots.acquire(A) == 0 and slots.acquire(B) == 1
    assert slots.acquire(C) is None  # both held
    assert not slots.can_acquire(C)
    slots.release(B)
    slots.release(A)  # A used last: B goes first
    assert slots.acquire(C) == 1 and slots.resident() == {A: 0, C: 1}
    assert slots.acquire(A) == 0  # still resident: no load
    assert slots.num_loads == 3
    slots.release(A)
    slots.release(C)
    assert slots.acquire(B) == 0 and B in slots.resident() and A not in slots.resident()


def test_config_checks_the_lora_limits() -> None:
    assert EngineConfig(max_loras=0).max_loras == 0
    with pytest.raises(EngineConfigError, match="max_loras"):
        EngineConfig(max_loras=-1)
    with pytest.raises(EngineConfigError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=0)


# -- the scheduler ---------------------------------------------------------------------


def request(rid: str, lora: LoRARequest | None) -> Request:
    return Request(rid, list(range(1, 9)), greedy(), lora_request=lora)


def test_a_request_whose_adapter_gets_no_slot_waits_and_those_behind_it_run() -> None:
    config = EngineConfig(block_size=4, max_loras=1, max_model_len=64)
    scheduler = Scheduler(config, num_kv_blocks=64)
    for r in (request("a1", A), request("b1", B), request("base", None), request("a2", A)):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["a1", "base", "a2"]
    assert [r.request_id for r in scheduler.waiting] == ["b1"]
    assert {r.lora_slot for r in scheduler.running} == {0, None}
    scheduler.finish_requests(["a1", "a2"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["b1"]  # base waits for its token
    assert scheduler.requests["b1"].lora_slot == 0
    assert scheduler.lora_slots.resident() == {B: 0}


def test_a_preempted_request_gives_its_slot_back() -> None:
    config = EngineConfig(block_size=4, max_loras=1, max_model_len=64)
    scheduler = Scheduler(config, num_kv_blocks=64)
    scheduler.add_request(request("a1", A))
    scheduler.schedule()
    victim = scheduler.requests["a1"]
    scheduler.running.remove(victim)
    scheduler._preempt(victim)
    assert victim.lora_slot is None and scheduler.lora_slots.num_held(0) == 0


def test_prefix_hashes_differ_per_adapter_and_per_path() -> None:
    hasher = BlockHasher(4, seed=1)
    roots = {
        hasher.first_parent(None),
        hasher.first_parent(None, A),
        hasher.first_parent(None, B),
        hasher.first_parent(None, LoRARequest("a", "/elsewhere/a")),
        hasher.first_parent("a", None),  # a tenant salted like an adapter's name
        hasher.first_parent("t", A),
    }
    assert len(roots) == 6
    assert hasher.first_parent("t", A) == BlockHasher(4, seed=1).first_parent("t", A)


# -- the worker's conversion -----------------------------------------------------------


def test_the_worker_passes_the_adapter_to_the_engine() -> None:
    message = GenerateRequest(
        request_id="r1",
        tenant_id="t",
        model="base",
        adapter=AdapterRef(name="sql", path="/adapters/sql"),
        prompt_token_ids=[5, 6, 7],
        reply_to="gw",
        created_ms=0,
    )
    work = WorkItem(message, TopicPartition("topic", 0), 0, None, 0)
    assert engine_request(work).lora_request == LoRARequest("sql", "/adapters/sql")
    work.request = message.model_copy(update={"adapter": None})
    assert engine_request(work).lora_request is None


# -- other backends ------------------------------------------------------------------


def test_the_sim_backend_accepts_an_adapter() -> None:
    from sluice.engine.backends.sim.core import SimCore
    from sluice.engine.backends.sim.presets import SIM_PRESETS

    preset = next(iter(SIM_PRESETS.values()))
    core = SimCore(preset, max_model_len=preset.max_model_len, vocab_size=1000)
    core.add(EngineRequest("r", [1, 2, 3], greedy(3), lora_request=A))
    done: list[EngineDelta] = []
    while core.has_unfinished():
        done += [d for d in core.finish_step(core.schedule()) if d.finished]
    assert [(d.request_id, d.finish_reason, d.num_output_tokens) for d in done] == [
        ("r", "length", 3)
    ]


def test_the_upstream_body_names_the_adapter_as_its_model() -> None:
    with_adapter = EngineRequest("r", [1, 2], greedy(), lora_request=A)
    assert completion_body("base", [1, 2], with_adapter, 0)["model"] == "a"
    assert completion_body("base", [1, 2], EngineRequest("r", [1, 2], greedy()), 0)["model"] == (
        "base"
    )


STANDIN = Path(__file__).parent / "trtllm_standin"


@pytest.fixture
def standin() -> Iterator[None]:
    """`import tensorrt_llm` finds the stand-in for this test only."""
    sys.path.insert(0, str(STANDIN))
    try:
        yield
    finally:
        sys.path.remove(str(STANDIN))
        for name in [n for n in sys.modules if n.split(".")[0] == "tensorrt_llm"]:
            del sys.modules[name]


@pytest.mark.usefixtures("standin")
def test_the_trtllm_backend_refuses_an_adapter_by_name() -> None:
    from sluice.engine.backends.trtllm_backend import TrtllmEngineBackend

    async def main() -> None:
        backend = TrtllmEngineBackend(STANDIN / "model", max_model_len=64, vocab_size=97)
        backend.start()
        try:
            with pytest.raises(RequestRejectedError, match="adapter 'a'"):
                backend.submit(EngineRequest("r", [1, 2], greedy(), lora_request=A))
        finally:
            backend.shutdown()

    asyncio.run(main())


@pytest.mark.slow  # starts an interpreter that imports torch
def test_the_adapter_crosses_the_engine_process_pipe(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("peft")
    from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
    from sluice.engine.backends.torch_backend import TorchEngineBackend
    from sluice.engine.loader import resolve_model_dir
    from tests.unit.engine.lora_adapters import make_adapter

    config = EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=256)
    model_dir = resolve_model_dir("tiny-llama", tmp_path)
    adapter = make_adapter(model_dir, tmp_path_factory.mktemp("adapter"), seed=3)
    lora = LoRARequest("three", str(adapter))
    prompt = [1, 17, 42, 99, 7, 300, 12]

    async def outputs(engine: TorchEngineBackend | ProcessEngineBackend) -> dict[str, list]:
        engine.start()
        stream = engine.deltas()
        engine.submit(EngineRequest("lora", prompt, greedy(12), lora_request=lora))
        engine.submit(EngineRequest("base", prompt, greedy(12)))
        bad = LoRARequest("bad", str(tmp_path / "missing"))
        engine.submit(EngineRequest("bad", prompt, greedy(12), lora_request=bad))
        got: dict[str, list[EngineDelta]] = {}
        async with asyncio.timeout(120):
            async for batch in stream:
                for delta in batch:
                    got.setdefault(delta.request_id, []).append(delta)
                if sum(d.finished for ds in got.values() for d in ds) == 3:
                    break
        await asyncio.to_thread(engine.shutdown, 10.0)
        return {
            rid: [[t for d in ds for t in d.token_ids], ds[-1].finish_reason]
            for rid, ds in got.items()
        }

    thread = asyncio.run(
        outputs(TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=tmp_path))
    )
    process = asyncio.run(outputs(ProcessEngineBackend(EngineSpec("tiny-llama", config, tmp_path))))
    assert process == thread
    assert thread["lora"][0] != thread["base"][0] and thread["lora"][1] == "length"
    assert thread["bad"] == [[], "error"]
