"""The sim backend's model: step times, KV capacity and preemption, prefix-cache hits,
tokens and stops, the presets' calibration, and how little CPU it takes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.backends.sim.calibrate import steady_state_tokens_per_s
from sluice.engine.backends.sim.core import SimCore
from sluice.engine.backends.sim.presets import PUBLISHED_TOKENS_PER_S, SIM_PRESETS, SimPreset
from sluice.engine.backends.sim_backend import SimEngineBackend
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.backend_contract import collect

PRESET = SimPreset(
    name="test",
    base_ms=5.0,
    per_seq_us=10.0,
    per_token_us=20.0,
    per_kv_token_ns=10.0,
    per_pair_ps=100.0,
    num_kv_blocks=256,
    max_num_seqs=64,
    max_num_batched_tokens=256,
    max_model_len=1024,
)


def make_core(preset: SimPreset = PRESET, **kwargs: object) -> SimCore:
    return SimCore(preset, max_model_len=preset.max_model_len, vocab_size=1000, **kwargs)  # type: ignore[arg-type]


def run(core: SimCore) -> tuple[dict[str, list[EngineDelta]], float]:
    """Step `core` on its modelled clock until every request finished."""
    out: dict[str, list[EngineDelta]] = {}
    elapsed = 0.0
    while core.has_unfinished():
        step = core.schedule()
        assert step.scheduled, "live requests but nothing scheduled: the core is stuck"
        elapsed += step.time_s
        for delta in core.finish_step(step):
            out.setdefault(delta.request_id, []).append(delta)
    return out, elapsed


def params(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def test_decode_step_time_grows_with_batch_and_context() -> None:
    times = []
    for batch in (1, 8, 32):
        core = make_core()
        for i in range(batch):
            core.add(EngineRequest(f"r{i}", [i + 1] * 4, params(10)))
        core.finish_step(core.schedule())  # the prompts: every request now decodes
        times.append(core.schedule().time_s)
    assert times[0] < times[1] < times[2]
    assert times[0] == pytest.approx(
        PRESET.step_time_s(num_seqs=1, num_tokens=1, num_kv_tokens=5, pairs=0)
    )
    assert PRESET.step_time_s(1, 1, 5000, 0) > PRESET.step_time_s(1, 1, 5, 0)  # longer context
    assert PRESET.step_time_s(0, 0, 0, 0) == 0.0


def test_a_minimum_step_time_floors_small_steps_only() -> None:
    paced = PRESET.replace(min_step_ms=50.0)
    assert paced.step_time_s(1, 1, 5, 0) == pytest.approx(0.050)
    big = (2048, 8192, 10_000_000, 0)  # a step the roofline makes longer than the floor
    assert paced.step_time_s(*big) == PRESET.step_time_s(*big) > 0.050
    assert paced.step_time_s(0, 0, 0, 0) == 0.0


def test_prompts_are_chunked_to_the_token_budget() -> None:
    core = make_core()
    core.add(EngineRequest("long", list(range(1, 601)), params(2)))
    chunks = []
    while core.has_unfinished():
        step = core.schedule()
        chunks.append(sum(n for _, n in step.scheduled))
        core.finish_step(step)
    assert chunks == [256, 256, 88, 1]  # budget 256; the last chunk samples; one decode


def test_preemption_at_kv_capacity_and_every_request_still_completes() -> None:
    # 8 blocks of 16 tokens; each request grows to 20 + 40 = 60 tokens (4 blocks)
    core = make_core(PRESET.replace(num_kv_blocks=8))
    for i in range(4):
        core.add(EngineRequest(f"r{i}", [i + 1] * 20, params(40)))
    out, _ = run(core)
    assert core.num_preemptions > 0
    for i in range(4):
        deltas = out[f"r{i}"]
        assert [d.finished for d in deltas].count(True) == 1
        assert deltas[-1].finish_reason == "length"
        assert len([t for d in deltas for t in d.token_ids]) == 40
    assert core.kv.num_available == core.kv.num_blocks and not core.kv.refs


def test_reserving_max_tokens_admits_what_fits_and_never_preempts() -> None:
    core = make_core(PRESET.replace(num_kv_blocks=8, reserve_max_tokens=True))
    for i in range(4):
        core.add(EngineRequest(f"r{i}", [i + 1] * 20, params(40)))
    first = core.schedule()
    assert [sim.request_id for sim, _ in first.scheduled] == ["r0", "r1"]  # 4 blocks each
    assert core.kv.num_available == 0
    core.finish_step(first)
    out, _ = run(core)
    assert core.num_preemptions == 0
    assert all(out[f"r{i}"][-1].num_output_tokens == 40 for i in range(4))


def test_preempted_request_resumes_with_the_same_tokens() -> None:
    alone = make_core()
    alone.add(EngineRequest("r0", [1] * 20, params(40)))
    crowded = make_core(PRESET.replace(num_kv_blocks=8))
    for i in range(4):
        crowded.add(EngineRequest(f"r{i}", [1 + i] * 20, params(40)))
    tokens = [[t for d in run(core)[0]["r0"] for t in d.token_ids] for core in (alone, crowded)]
    assert tokens[0] == tokens[1]


def test_a_repeated_prefix_reports_cached_tokens_per_salt() -> None:
    core = make_core()
    shared = list(range(1, 49))  # three full blocks
    core.add(EngineRequest("first", [*shared, 900, 901], params(2)))
    run(core)
    core.add(EngineRequest("again", [*shared, 700], params(2)))
    core.add(EngineRequest("other-tenant", [*shared, 700], params(2), cache_salt="t2"))
    first_step = core.schedule()
    assert {sim.request_id: n for sim, n in first_step.scheduled} == {
        "again": 1,  # only the uncached last token is prefilled
        "other-tenant": 49,
    }
    core.finish_step(first_step)
    out, _ = run(core)
    assert out["again"][-1].num_cached_tokens == 48
    assert out["other-tenant"][-1].num_cached_tokens == 0
    assert core.num_cached_tokens == 48


def test_cached_prefix_makes_the_prefill_step_shorter() -> None:
    prompt = list(range(1, 201))
    cold, warm = make_core(), make_core()
    warm.add(EngineRequest("earlier", prompt, params(1)))
    run(warm)
    for core in (cold, warm):
        core.add(EngineRequest("r", prompt, params(1)))
    assert warm.schedule().time_s < cold.schedule().time_s


def test_tokens_are_deterministic_and_honour_stop_tokens_and_strings() -> None:
    core = make_core()
    core.add(EngineRequest("r", [1, 2, 3], params(20)))
    tokens = [t for d in run(core)[0]["r"] for t in d.token_ids]
    assert len(set(tokens)) > 1 and all(t >= 250 for t in tokens)  # never low/special ids
    greedy = make_core()
    greedy.add(EngineRequest("a", [1, 2, 3], params(20, temperature=0.0)))
    greedy.add(EngineRequest("b", [1, 2, 3], params(20, temperature=0.0)))
    greedy.add(EngineRequest("c", [1, 2, 4], params(20, temperature=0.0)))
    out = {rid: [t for d in ds for t in d.token_ids] for rid, ds in run(greedy)[0].items()}
    assert out["a"] == out["b"] != out["c"]  # greedy: the prompt decides, as with a model

    stop_at = make_core()
    stop_at.add(EngineRequest("r", [1, 2, 3], params(20, stop_token_ids=[tokens[5]])))
    last = run(stop_at)[0]["r"][-1]
    assert (last.finish_reason, last.stop_reason, last.num_output_tokens) == ("stop", tokens[5], 6)

    text = "".join(core.pieces[t] for t in tokens)
    stop = text[10:14]
    by_string = make_core()
    by_string.add(EngineRequest("r", [1, 2, 3], params(20, stop=[stop])))
    deltas = run(by_string)[0]["r"]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]


def test_eos_draws_end_requests_unless_ignore_eos() -> None:
    core = make_core(eos_token_ids=[2], eos_probability=0.2)
    for i in range(20):
        core.add(EngineRequest(f"r{i}", [1, 2, 3], params(50)))
        core.add(EngineRequest(f"keep{i}", [1, 2, 3], params(50, ignore_eos=True)))
    out, _ = run(core)
    stopped = [d[-1] for rid, d in out.items() if rid.startswith("r")]
    assert any(d.finish_reason == "stop" and d.token_ids == [2] for d in stopped)
    assert all(out[f"keep{i}"][-1].num_output_tokens == 50 for i in range(20))


def test_logprobs_carry_the_sampled_token_and_alternatives() -> None:
    core = make_core()
    core.add(EngineRequest("r", [1, 2], params(3, logprobs=2)))
    deltas = run(core)[0]["r"]
    for delta in deltas:
        assert delta.logprobs is not None and delta.logprobs[0].token_id == delta.token_ids[0]
        assert len(delta.logprobs[0].top_logprobs) == 2


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOKENS_PER_S))
def test_presets_match_the_published_throughput(name: str) -> None:
    """The fit (engine.backends.sim.calibrate) stays within 10% of every published point."""
    preset = SIM_PRESETS[name]
    for (isl, osl), published in PUBLISHED_TOKENS_PER_S[name].items():
        modelled = steady_state_tokens_per_s(preset, isl, osl)
        assert modelled == pytest.approx(published, rel=0.10), (isl, osl)


class VirtualTime:
    """A clock that moves only when the sim sleeps, by what it sleeps: the modelled time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)  # the loop turn a real wait gives


def run_backend(
    preset: SimPreset, requests: list[EngineRequest], vocab_size: int
) -> tuple[VirtualTime, dict[str, list[EngineDelta]]]:
    """`requests`, submitted at once, through the backend on a virtual clock."""

    async def main() -> dict[str, list[EngineDelta]]:
        backend = SimEngineBackend(
            preset, vocab_size=vocab_size, clock=clock.time, sleep=clock.sleep
        )
        backend.start()
        for request in requests:
            backend.submit(request)
        out = await collect(backend, {r.request_id for r in requests})
        backend.shutdown()
        return out

    clock = VirtualTime()
    return clock, asyncio.run(main())


def test_backend_sleeps_the_modelled_step_times() -> None:
    preset = PRESET.replace(base_ms=10.0)
    core = make_core(preset)
    core.add(EngineRequest("r", [1, 2, 3], params(20)))
    _, modelled = run(core)
    clock, _ = run_backend(preset, [EngineRequest("r", [1, 2, 3], params(20))], 1000)
    assert len(clock.sleeps) == 20  # one wait per step, a token each
    assert clock.now == pytest.approx(modelled)
    assert modelled >= 20 * 0.010  # 20 steps of at least base_ms each


def test_two_hundred_requests_wait_once_per_step_and_never_spin() -> None:
    """The sim is for load tests of the pipeline: it must leave the CPU to it. Its loop
    waits out each modelled step once, the same schedule as the core alone, and polls
    nothing in between (what a step costs the CPU is a benchmark's figure)."""
    preset = SIM_PRESETS["h200-llama3.1-8b-fp8"]
    requests = [EngineRequest(f"r{i}", [i, *range(1, 512)], params(128)) for i in range(200)]
    core = SimCore(preset, max_model_len=preset.max_model_len, vocab_size=128_256)
    for request in requests:
        core.add(request)
    _, modelled = run(core)
    clock, out = run_backend(preset, requests, 128_256)
    assert sum(len(d.token_ids) for ds in out.values() for d in ds) == 200 * 128
    assert len(clock.sleeps) == core.num_steps
    assert clock.now == pytest.approx(modelled)


def test_the_sim_never_imports_torch() -> None:
    code = (
        "import sys, engine.backends.sim_backend, engine.backends.sim.calibrate;"
        "sys.exit('torch' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wiring_builds_the_sim_on_the_served_models_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLUICE_BACKEND=sim (the composition root's choice; here beside the sim's tests)."""
    from sluice import wiring
    from sluice.settings import EngineWorkerSettings, SettingsError

    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "7")
    settings = EngineWorkerSettings(backend="sim", data_dir=tmp_path, max_model_len=256)
    backend = wiring.build_backend(settings, wiring.engine_options(settings))
    assert isinstance(backend, SimEngineBackend)
    assert backend.preset.name == settings.sim_preset == "h200-llama3.1-8b-fp8"
    assert backend.preset.max_num_seqs == 7  # set: overrides the preset's
    assert backend.preset.max_num_batched_tokens == 8192  # unset: the preset's
    assert backend.max_model_len == 256 and backend.vocab_size == 512  # tiny-llama's
    assert backend.tokenizer is not None

    wrong = EngineWorkerSettings(backend="sim", sim_preset="a100-nope", data_dir=tmp_path)
    with pytest.raises(SettingsError, match="is not a sim preset"):
        wiring.build_backend(wrong, wiring.engine_options(wrong))
