"""Fits and checks the sim presets against published throughput: `python -m
engine.backends.sim.calibrate [--fit] [PRESET...]`.

How the presets' coefficients were chosen (engine.backends.sim.presets): `fit` searches
the coefficients that make a steady-state estimate of max-load output throughput match
`PUBLISHED_TOKENS_PER_S` (least squares on log throughput); `simulate` then runs the
real `SimCore` on a modelled clock (no sleeping) with every request queued at once, as
trtllm-bench does, and the table shows both beside the published figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from sluice.engine.backends.base import EngineRequest
from sluice.engine.backends.sim.core import SimCore
from sluice.engine.backends.sim.presets import PUBLISHED_TOKENS_PER_S, SIM_PRESETS, SimPreset
from sluice.engine.sampling import SamplingParams

_COEFFICIENTS = ("base_ms", "per_token_us", "per_kv_token_ns", "per_pair_ps")


def steady_state_tokens_per_s(preset: SimPreset, isl: int, osl: int) -> float:
    """Output tokens/s with the engine full: as many decoding requests as the batch, the KV
    cache (each holds isl + osl/2 tokens on average, isl + osl when it reserves them) and
    the token budget (each also needs isl/osl prompt tokens per output token) allow;
    prompt chunks ride along each step."""
    per_output = isl / osl  # prompt tokens scheduled per decode token
    held = isl + osl if preset.reserve_max_tokens else isl + osl / 2
    num_decoding = min(
        preset.max_num_seqs,
        preset.kv_capacity_tokens / held,
        preset.max_num_batched_tokens / (1 + per_output),
    )
    step_s = preset.step_time_s(
        num_seqs=round(num_decoding),
        num_tokens=round(num_decoding * (1 + per_output)),
        num_kv_tokens=round(num_decoding * (isl + osl / 2)),
        pairs=round(num_decoding * per_output * isl / 2),
    )
    return num_decoding / step_s


def simulate(preset: SimPreset, isl: int, osl: int, num_requests: int) -> float:
    """Output tokens/s of `num_requests` queued at once, on the modelled clock."""
    core = SimCore(preset, max_model_len=isl + osl + 1, vocab_size=128_256)
    params = SamplingParams(max_tokens=osl, ignore_eos=True)
    for i in range(num_requests):
        # distinct prompts: no prefix-cache hits, as trtllm-bench's random tokens
        core.add(EngineRequest(f"r{i}", [i, *range(isl - 1)], params))
    elapsed = 0.0
    while core.has_unfinished():
        step = core.schedule()
        elapsed += step.time_s
        core.finish_step(step)
    return num_requests * osl / elapsed


def fit(preset: SimPreset, published: dict[tuple[int, int], float]) -> SimPreset:
    """Coordinate search in log space over `_COEFFICIENTS`, from `preset`'s values."""

    def loss(candidate: SimPreset) -> float:
        return sum(
            math.log(steady_state_tokens_per_s(candidate, isl, osl) / tokens_per_s) ** 2
            for (isl, osl), tokens_per_s in published.items()
        )

    best, best_loss = preset, loss(preset)
    factor = 2.0
    while factor > 1.001:
        improved = False
        for name in _COEFFICIENTS:
            for scale in (factor, 1 / factor):
                value = max(getattr(best, name), 1e-3) * scale
                candidate = dataclasses.replace(best, **{name: value})
                candidate_loss = loss(candidate)
                if candidate_loss < best_loss:
                    best, best_loss, improved = candidate, candidate_loss, True
        if not improved:
            factor = math.sqrt(factor)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", default=sorted(PUBLISHED_TOKENS_PER_S))
    parser.add_argument("--fit", action="store_true", help="fit the coefficients first")
    parser.add_argument("--requests", type=int, default=1500, help="per ISL/OSL point")
    args = parser.parse_args()
    for name in args.presets:
        preset, published = SIM_PRESETS[name], PUBLISHED_TOKENS_PER_S[name]
        if args.fit:
            preset = fit(preset, published)
            print(name, {k: round(getattr(preset, k), 3) for k in _COEFFICIENTS})
        print(f"{name}: ISL/OSL  published  steady-state  simulated  (output tokens/s)")
        for (isl, osl), tokens_per_s in published.items():
            steady = steady_state_tokens_per_s(preset, isl, osl)
            simulated = simulate(preset, isl, osl, args.requests)
            print(
                f"  {isl:>5}/{osl:<5} {tokens_per_s:>9,.0f} {steady:>13,.0f} {simulated:>10,.0f}"
                f"  ({simulated / tokens_per_s - 1:+.0%})"
            )


if __name__ == "__main__":
    main()
