"""The benchmarks' small statistics."""

from __future__ import annotations

import math

import pytest

from benchmarks.stats import mean_ci95


def test_mean_ci95_uses_students_t_for_few_values() -> None:
    mean, half = mean_ci95([0.9, 1.0, 1.1, 1.0])
    assert mean == pytest.approx(1.0)
    # sd 0.0816, n 4, t(3) 3.18
    assert half == pytest.approx(3.18 * 0.08165 / 2, rel=1e-3)


def test_mean_ci95_of_many_values_approaches_the_normal() -> None:
    values = [1.0, 2.0] * 50
    _, half = mean_ci95(values)
    assert half == pytest.approx(1.96 * 0.50252 / 10, rel=1e-3)


def test_mean_ci95_needs_two_values() -> None:
    assert math.isnan(mean_ci95([1.0])[1]) and mean_ci95([1.0])[0] == 1.0
    assert all(math.isnan(x) for x in mean_ci95([]))
