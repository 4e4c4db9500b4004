"""Percentiles and small formatting helpers shared by the benchmarks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3) if denominator else math.nan


def run_figures(generated: int, elapsed_s: float, first_token_s: Iterable[float]) -> dict:
    """One offline run of an engine: tokens/s, the median time to each request's first
    token, and the raw counts (stdlib only: vLLM's runner, in its own venv, uses it too)."""
    return {
        "tokens_per_s": generated / elapsed_s,
        "ttft_ms": statistics.median(first_token_s) * 1e3,
        "generated_tokens": generated,
        "elapsed_s": elapsed_s,
    }
