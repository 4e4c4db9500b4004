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


# Student's t at 97.5 % by degrees of freedom (a few rounds per run: the normal 1.96 would
# understate the interval); 1.96 past the table
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}  # fmt: skip


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """The mean of `values` and the half-width of its 95 % confidence interval (t-based;
    nan with fewer than two values)."""
    if len(values) < 2:
        return (values[0] if values else math.nan), math.nan
    dof = len(values) - 1
    t = next((v for k, v in sorted(_T975.items()) if k >= dof), 1.96)
    return statistics.fmean(values), t * statistics.stdev(values) / math.sqrt(len(values))


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
