"""The backend contract (backend_contract.py) on the torch thread backend, the sim, and
two torch thread backends behind a `ReplicatedBackend`."""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.backends.replicated import ReplicatedBackend
from sluice.engine.backends.sim.presets import SimPreset
from sluice.engine.backends.sim_backend import SimEngineBackend
from sluice.engine.backends.torch_backend import TorchEngineBackend
from sluice.engine.config import EngineConfig
from sluice.engine.core.outputs import RunnerOutput, SchedulerOutput
from sluice.engine.engine_core import EngineCore
from tests.unit.engine.backend_contract import (
    CHECKS,
    KILL_MESSAGE,
    ContractTarget,
    check_dead_engine_fails_in_flight_requests,
)
from tests.unit.engine.fakes import FakeRunner

STEP_S = 0.002  # each target's step: long enough to act mid-stream, short enough to be quick

_kill_switches: weakref.WeakKeyDictionary[Any, threading.Event] = weakref.WeakKeyDictionary()


def _killable(backend: TorchEngineBackend) -> TorchEngineBackend:
    """Wrap the runner: each step takes at least STEP_S and raises once killed."""
    runner = backend.core.runner
    execute: Callable[[SchedulerOutput], RunnerOutput] = runner.execute
    dead = threading.Event()

    def step(scheduler_output: SchedulerOutput) -> RunnerOutput:
        if dead.is_set():
            raise RuntimeError(KILL_MESSAGE)
        time.sleep(STEP_S)
        return execute(scheduler_output)

    runner.execute = step  # type: ignore[method-assign]
    _kill_switches[backend] = dead
    return backend


def _kill_torch(backend: TorchEngineBackend) -> None:
    _kill_switches[backend].set()


def make_fake_torch(*, max_num_seqs: int = 64, max_model_len: int = 64) -> TorchEngineBackend:
    config = EngineConfig(
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    core = EngineCore(config, FakeRunner(64, 4, vocab_size=97), hash_seed=0)
    return _killable(TorchEngineBackend(core))


SIM_TEST_PRESET = SimPreset(
    name="contract-test",
    base_ms=STEP_S * 1e3,
    per_seq_us=0.0,
    per_token_us=1.0,
    per_kv_token_ns=0.0,
    per_pair_ps=0.0,
    num_kv_blocks=64,
    max_num_seqs=64,
    max_num_batched_tokens=64,
    max_model_len=64,
)


def make_sim(*, max_num_seqs: int = 64, max_model_len: int = 64) -> SimEngineBackend:
    preset = SIM_TEST_PRESET.replace(max_num_seqs=max_num_seqs)
    return SimEngineBackend(preset, max_model_len=max_model_len, vocab_size=97)


def _kill_sim(backend: SimEngineBackend) -> None:
    backend.kill(RuntimeError(KILL_MESSAGE))


def make_replicated(*, max_num_seqs: int = 64, max_model_len: int = 64) -> ReplicatedBackend:
    """Two fake-runner engines behind one backend."""
    make = functools.partial(
        make_fake_torch, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    return ReplicatedBackend([make(), make()])


def _kill_replicas(backend: ReplicatedBackend) -> None:
    for replica in backend.replicas:
        _kill_torch(replica)  # type: ignore[arg-type]


TARGETS = [
    ContractTarget("torch-fake-runner", make_fake_torch, _kill_torch),
    ContractTarget("sim", make_sim, _kill_sim),
    ContractTarget("replicated", make_replicated, _kill_replicas),
]


def _applies(target: ContractTarget, check: Callable[[ContractTarget], None]) -> bool:
    # replicas die one by one: each death's requests may come in the stream after the
    # first death ended one (test_replicated_backend covers it)
    return not (target.name == "replicated" and check is check_dead_engine_fails_in_flight_requests)


@pytest.mark.parametrize(
    ("target", "check"),
    [(t, c) for t in TARGETS for c in CHECKS if _applies(t, c)],
    ids=lambda x: getattr(x, "name", None) or x.__name__.removeprefix("check_"),
)
def test_backend_contract(target: ContractTarget, check: Callable[[ContractTarget], None]) -> None:
    check(target)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> ContractTarget:
    """The torch backend on the real tiny-llama model (random weights, vocab 512)."""
    data_dir: Path = tmp_path_factory.mktemp("tiny-llama")

    def make(*, max_num_seqs: int = 64, max_model_len: int = 64) -> TorchEngineBackend:
        config = EngineConfig(
            device="cpu",
            dtype="float32",
            kv_cache_mb=4.0,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            max_model_len=max_model_len,
        )
        backend = TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=data_dir)
        return _killable(backend)

    return ContractTarget("torch-tiny-llama", make, _kill_torch)


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_backend_contract_on_tiny_llama(
    tiny_llama: ContractTarget, check: Callable[[ContractTarget], None]
) -> None:
    check(tiny_llama)
