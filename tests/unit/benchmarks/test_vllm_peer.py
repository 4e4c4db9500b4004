"""The vLLM peer of `benchmarks.engine` without vLLM: its messages, the runner's loop, the
client over a real pipe to a fake runner, the per-rep ratio and the not-installed skip."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from benchmarks import engine, vllm_peer
from benchmarks.vllm_peer import PeerError, PeerSetup, VllmPeer, Workload, serve
from tests.unit.benchmarks.fake_vllm_peer import FakeEngine

FAKE_RUNNER = [sys.executable, "-m", "tests.unit.benchmarks.fake_vllm_peer"]


def setup() -> PeerSetup:
    return PeerSetup(
        model="/models/m",
        dtype="bfloat16",
        threads_bind="0,1",
        workloads={
            "mixed": Workload("mixed", [[5, 6, 7], [8, 9]], [16, 3]),
            "batch1": Workload("batch1", [[5] * 64], [32]),
        },
    )


def test_setup_survives_the_json_line() -> None:
    line = setup().to_json()
    assert "\n" not in line
    assert PeerSetup.from_json(line) == setup()


def test_the_runner_answers_each_command_and_survives_a_bad_one() -> None:
    commands = [setup().to_json(), '{"name": "mixed"}', '{"name": "nope"}', "", "junk"]
    out = io.StringIO()
    serve(FakeEngine, [c + "\n" for c in commands], out)
    ready, mixed, unknown, junk = (json.loads(x) for x in out.getvalue().splitlines())
    assert ready == {"ready": {"version": "0.0-fake", "settings": {"dtype": "bfloat16"}}}
    assert mixed == {"tokens_per_s": 19.0, "prompts": 2}
    assert "nope" in unknown["error"]
    assert "junk" in junk["error"]


def test_client_runs_workloads_by_name_over_the_pipe() -> None:
    with VllmPeer(setup(), command=FAKE_RUNNER, settle_s=0) as peer:
        assert peer.wait_ready().version == "0.0-fake"
        assert peer.run("batch1") == {"tokens_per_s": 32.0, "prompts": 1}
        assert peer.run("mixed")["tokens_per_s"] == 19.0
        with pytest.raises(PeerError, match="nope"):
            peer.run("nope")
        assert peer.run("mixed")["prompts"] == 2  # still up after an error


def test_client_quotes_the_runners_stderr_when_it_dies() -> None:
    crash = [sys.executable, "-c", "import sys; sys.stderr.write('no module vllm'); sys.exit(3)"]
    with (
        pytest.raises(PeerError, match=r"(?s)rc=3.*no module vllm"),
        VllmPeer(setup(), command=crash, settle_s=0) as peer,
    ):
        peer.wait_ready()


def test_environment_carries_the_cpu_settings() -> None:
    assert vllm_peer.peer_environment(setup()) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def test_vllm_ratio_is_the_median_of_paired_reps() -> None:
    sluice = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 90.0}]
    vllm = [{"tokens_per_s": 200.0}, {"tokens_per_s": 50.0}, {"tokens_per_s": 100.0}]
    w: dict = {"ratios": {}}
    engine._paired({"sluice": sluice, "vllm": vllm}, w)
    # the median pair (0.9), not the ratio of the median runs (90 / 100)
    assert w == {"ratios": {"sluice_vs_vllm": 0.9}, "sluice_vs_vllm_per_rep": [0.5, 1.0, 0.9]}
    engine._paired({"sluice": sluice, "vllm": [{"tokens_per_s": 0.0}] * 3}, w)
    assert w["ratios"]["sluice_vs_vllm"] is None


def test_workloads_are_the_same_for_every_system() -> None:
    work = engine.bench_workloads(quick=True, vocab=32000)
    assert work == engine.bench_workloads(quick=True, vocab=32000)
    assert len(work["mixed"].prompts) == 16 and len(work["mixed"].outputs) == 16
    assert [len(p) for p in work["batch1"].prompts] == [64] and work["batch1"].outputs == [32]


def test_without_the_peer_venv_the_result_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(vllm_peer, "PEER_PYTHON", tmp_path / "missing" / "python")
    skipped: dict[str, str] = {}
    work = engine.bench_workloads(quick=True, vocab=100)
    assert engine._start_vllm(tmp_path, "bfloat16", work, skipped) is None
    assert skipped == {"vllm": "run scripts/peers vllm"}
