"""The trtllm backend on the stand-in `tensorrt_llm` (tests/unit/engine/trtllm_standin):
the backend contract, the stand-in's signatures against the recorded real ones, cache
salts, lane priorities and runtime stats, that no other module imports tensorrt_llm, and
scripts/gpu-check's exit without a GPU."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.backends.base import EngineRequest
from sluice.engine.backends.trtllm_backend import TrtllmEngineBackend
from tests.unit.engine.backend_contract import (
    CHECKS,
    KILL_MESSAGE,
    ContractTarget,
    collect,
    greedy,
)
from tests.waiting import wait_until_async

ROOT = Path(__file__).resolve().parents[3]
STANDIN = Path(__file__).parent / "trtllm_standin"
API = ROOT / "engine" / "backends" / "trtllm_api.txt"


@pytest.fixture(autouse=True, scope="module")
def standin() -> Iterator[None]:
    """`import tensorrt_llm` finds the stand-in for these tests only."""
    sys.path.insert(0, str(STANDIN))
    try:
        yield
    finally:
        sys.path.remove(str(STANDIN))
        for name in [n for n in sys.modules if n.split(".")[0] == "tensorrt_llm"]:
            del sys.modules[name]


def make_backend(*, max_num_seqs: int = 64, max_model_len: int = 64) -> TrtllmEngineBackend:
    return TrtllmEngineBackend(
        STANDIN / "model",  # the stand-in reads nothing there
        max_model_len=max_model_len,
        vocab_size=97,
        max_num_seqs=max_num_seqs,
        # a read of the statistics ends after this long without a new iteration's: long
        # beside a step, even on a loaded machine, so no step's statistics are missed
        stats_interval_s=1.0,
    )


def kill(backend: TrtllmEngineBackend) -> None:
    backend.llm._standin_fail(RuntimeError(KILL_MESSAGE))


TARGET = ContractTarget("trtllm-standin", make_backend, kill)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_contract(check: Any) -> None:
    check(TARGET)


# -- the stand-in has the recorded surface ------------------------------------------------


def _render(signature: inspect.Signature) -> str:
    """A signature as the recorded list writes it: names, kinds and defaults only."""
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=plain, return_annotation=inspect.Signature.empty))


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _recorded() -> list[str]:
    lines = [line.strip() for line in API.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_standin_signatures_match_the_recorded_api() -> None:
    checked = 0
    for line in _recorded():
        if line.startswith(("attr ", "stat ")):
            continue
        name, params = line.split("(", 1)
        assert _render(inspect.signature(_resolve(name))) == f"({params}", name
        checked += 1
    assert checked >= 6


def test_standin_results_and_stats_have_the_recorded_attributes() -> None:
    from tensorrt_llm import LLM, SamplingParams

    async def main() -> tuple[Any, dict[str, Any]]:
        llm = LLM(model="unused", enable_iter_perf_stats=True)
        result = llm.generate_async([1, 2, 3], SamplingParams(max_tokens=2), streaming=True)
        async for _ in result:
            pass
        stats = [s async for s in llm.get_stats_async(timeout=0.05)]
        llm.shutdown()
        return result, stats[-1]

    result, stats = asyncio.run(main())
    for line in _recorded():
        kind, _, name = line.partition(" ")
        if kind == "attr":
            owner, attr = name.rsplit(".", 1)
            instance = result if owner.endswith("RequestOutput") else result.outputs[0]
            assert hasattr(instance, attr), name
        elif kind == "stat":
            value: Any = stats
            for key in name.split("."):
                value = value[key]
            assert isinstance(value, int), name


def test_the_backend_passes_only_recorded_llm_arguments() -> None:
    from tensorrt_llm.llmapi.llm import _LLM_ARGS

    backend = make_backend()
    backend.load()
    assert set(backend.llm.args) <= _LLM_ARGS
    assert backend.llm.args["backend"] == "pytorch"
    backend.shutdown()


def test_only_the_backend_imports_tensorrt_llm() -> None:
    importers = []
    for package in ("api", "bus", "consumers", "engine", "billing", "tracing", "sluice"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                if any(n.split(".")[0] == "tensorrt_llm" for n in names):
                    importers.append(str(path.relative_to(ROOT)))
    assert set(importers) == {"engine/backends/trtllm_backend.py"}


# -- what the backend hands TensorRT-LLM --------------------------------------------------


def test_cached_tokens_per_salt_and_text_from_the_runtime() -> None:
    prompt = list(range(1, 41))  # two full 16-token blocks, then 8 tokens

    async def main() -> dict[str, Any]:
        backend = make_backend()
        backend.start()
        backend.submit(EngineRequest("first", prompt, greedy(3), cache_salt="t1"))
        out = await collect(backend, {"first"})
        backend.submit(EngineRequest("again", prompt, greedy(3), cache_salt="t1"))
        backend.submit(EngineRequest("other", prompt, greedy(3), cache_salt="t2"))
        out.update(await collect(backend, {"again", "other"}))
        stats = backend.stats()
        backend.shutdown()
        return {"out": out, "stats": stats}

    result = asyncio.run(main())
    out = result["out"]
    assert [d.num_cached_tokens for d in (out[r][-1] for r in ("first", "again", "other"))] == [
        0,
        32,
        0,
    ]
    tokens = [t for d in out["first"] for t in d.token_ids]
    assert "".join(d.text for d in out["first"]) == "".join(f" t{t}" for t in tokens)
    assert result["stats"].num_cached_tokens == 32
    assert result["stats"].num_prompt_tokens == 120


def test_interactive_lane_overtakes_batch_lane_in_the_runtime_queue() -> None:
    async def main() -> list[str]:
        backend = make_backend(max_num_seqs=1)
        backend.start()
        backend.submit(EngineRequest("running", [1, 2], greedy(40)))
        finished: list[str] = []

        async def note(batch: list[Any]) -> None:
            finished.extend(d.request_id for d in batch if d.finished)

        async for batch in backend.deltas():
            if any(d.token_ids for d in batch):
                break  # "running" holds the runtime's only batch slot
        backend.submit(EngineRequest("batch", [1, 2], greedy(2), priority=2))
        backend.submit(EngineRequest("interactive", [1, 2], greedy(2), priority=0))
        await collect(backend, {"running", "batch", "interactive"}, note)
        backend.shutdown()
        return finished

    assert asyncio.run(main()) == ["running", "interactive", "batch"]


def test_stats_follow_the_runtime_while_requests_run() -> None:
    async def main() -> None:
        backend = make_backend(max_num_seqs=1, max_model_len=256)
        backend.start()
        backend.submit(EngineRequest("a", [1, 2], greedy(200)))  # aborted long before the end
        backend.submit(EngineRequest("b", [1, 2], greedy(200)))
        await wait_until_async(lambda: backend.stats().num_waiting == 1, 5.0, "one waiting")
        stats = backend.stats()
        assert stats.num_running == 1 and 0.0 < stats.kv_usage < 1.0
        assert stats.num_steps > 0 and stats.num_kv_blocks > 0
        backend.abort("a")
        backend.abort("b")
        await collect(backend, {"a", "b"})
        assert backend.stats().num_running == 0
        backend.shutdown()

    asyncio.run(main())


def test_max_tokens_is_capped_by_max_model_len() -> None:
    async def main() -> list[Any]:
        backend = make_backend(max_model_len=10)
        backend.start()
        backend.submit(EngineRequest("r", [1, 2, 3, 4], greedy(50)))
        out = await collect(backend, {"r"})
        backend.shutdown()
        return out["r"]

    deltas = asyncio.run(main())
    assert (deltas[-1].finish_reason, deltas[-1].num_output_tokens) == ("length", 6)


# -- scripts/gpu-check ------------------------------------------------------------------


def test_gpu_check_exits_2_without_a_gpu(tmp_path: Path) -> None:
    """No nvidia-smi on PATH: exit 2 and say why, before installing anything."""
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    env["PATH"] = str(tmp_path)  # an empty folder: no nvidia-smi, no python, no pip
    done = subprocess.run(
        ["/bin/bash", str(ROOT / "scripts" / "gpu-check")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "no NVIDIA GPU" in done.stderr and "nvidia-smi" in done.stderr
    assert done.stdout == ""


# -- the wiring -------------------------------------------------------------------------


def _settings(tmp_path: Path) -> Any:
    from sluice.settings import Settings

    (tmp_path / "config.json").write_text('{"vocab_size": 97, "max_position_embeddings": 64}')
    return Settings(backend="trtllm", model=str(tmp_path), data_dir=tmp_path, max_num_seqs=4)


def test_wiring_builds_the_trtllm_backend(tmp_path: Path) -> None:
    from sluice.wiring import build_backend, engine_options

    settings = _settings(tmp_path)
    backend = build_backend(settings, engine_options(settings))
    assert isinstance(backend, TrtllmEngineBackend)
    assert (backend.vocab_size, backend.max_model_len) == (97, 64)
    assert backend.llm.args["max_batch_size"] == 4
    assert backend.llm.args["kv_cache_config"].free_gpu_memory_fraction == 0.9
    backend.shutdown()


def test_wiring_without_tensorrt_llm_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.settings import SettingsError
    from sluice.wiring import build_backend, engine_options

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(STANDIN)])
    for name in [n for n in sys.modules if n.split(".")[0] == "tensorrt_llm"]:
        monkeypatch.delitem(sys.modules, name)
    settings = _settings(tmp_path)
    with pytest.raises(SettingsError, match=r"pip install -e '\.\[trtllm\]'"):
        build_backend(settings, engine_options(settings))


def test_text_never_shows_a_stop_string_even_split_across_steps() -> None:
    from tensorrt_llm.llmapi.llm import toy_piece, toy_token

    prompt = [5, 6]
    pieces = "".join(toy_piece(toy_token(prompt, i)) for i in range(8))
    stop = pieces[pieces.index(" t", 10) - 1 :][:4]  # spans the end of one piece and the next

    async def main() -> list[Any]:
        backend = make_backend()
        backend.start()
        params = greedy(8)
        params.stop = [stop]
        backend.submit(EngineRequest("r", prompt, params))
        out = await collect(backend, {"r"})
        backend.shutdown()
        return out["r"]

    deltas = asyncio.run(main())
    text = "".join(d.text for d in deltas)
    assert text == pieces[: pieces.index(stop)]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)


def test_logprobs_of_each_token_with_the_top_alternatives() -> None:
    async def main() -> list[Any]:
        backend = make_backend()
        backend.start()
        params = greedy(4)
        params.logprobs = 2
        backend.submit(EngineRequest("r", [5, 6], params))
        backend.submit(EngineRequest("plain", [5, 6], greedy(4)))
        out = await collect(backend, {"r", "plain"})
        backend.shutdown()
        assert all(d.logprobs is None for d in out["plain"])
        return out["r"]

    deltas = asyncio.run(main())
    logprobs = [lp for d in deltas for lp in d.logprobs or []]
    assert [lp.token_id for lp in logprobs] == [t for d in deltas for t in d.token_ids]
    assert all(lp.logprob == -0.5 and len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.top_logprobs[0] == (lp.token_id, -0.5) for lp in logprobs)
