"""Money maths (exact integers) and the x-ratelimit header formats."""

from __future__ import annotations

from decimal import Decimal

import pytest

from sluice.storage.errors import InvalidInput
from sluice.storage.prices import Price, parse_discount, picos_to_micros_ceil, picos_to_usd
from sluice.storage.quotas import Decision, Unfit, format_duration, ms_to_next_month, scaled, unfit
from sluice.storage.tenants import PlanLimits
from sluice.storage.usage import format_usd


def test_cost_is_exact_in_pico_dollars() -> None:
    price = Price("m", input_micros=2_500_000, cached_input_micros=1_250_000,
                  output_micros=10_000_000, batch_discount_bp=5000)  # fmt: skip
    # 1000 prompt (400 cached) + 200 completion at $2.50 / $1.25 / $10 per million
    picos = price.cost_picos(1000, 400, 200, batch=False)
    assert picos_to_usd(picos) == Decimal("0.0015") + Decimal("0.0005") + Decimal("0.002")
    assert price.cost_picos(1000, 400, 200, batch=True) == picos // 2
    assert price.cost_picos(10, 50, 0, batch=False) == 10 * 1_250_000  # cached <= prompt
    assert price.estimate_micros(1000, 200, batch=False) == 4500
    assert picos_to_micros_ceil(1) == 1 and picos_to_micros_ceil(1_000_000) == 1


def test_discounts_and_usd_formatting() -> None:
    assert parse_discount("0.5") == 5000
    for bad in ("1", "-0.1", "0.00001", "x"):
        with pytest.raises(InvalidInput):
            parse_discount(bad)
    assert format_usd(Decimal("12.5")) == "12.50"
    assert format_usd(Decimal("0.000000375")) == "0.000000375"
    assert format_usd(Decimal(0)) == "0.00"


def test_reset_durations_in_openai_format() -> None:
    assert format_duration(0.02) == "20ms"
    assert format_duration(1.5) == "1.5s"
    assert format_duration(60) == "1m0s"
    assert format_duration(360) == "6m0s"
    assert Decision(False, "tokens", 0.2).headers() == {"retry-after": "1"}
    assert Decision(False, "budget", 2_346_932).headers() == {}  # not retried: no wait


def test_a_call_larger_than_the_plan_can_never_fit() -> None:
    plan = PlanLimits(tpm=1000, max_concurrency=16)
    assert unfit(plan, [10] * 16) is None
    assert unfit(plan, [10] * 17) == Unfit("concurrency", 16, 17)
    assert unfit(plan, [500, 501]) == Unfit("tokens", 1000, 1001)
    assert unfit(PlanLimits(rpm=1), [10**9] * 100) is None  # no such limits


def test_month_boundary_and_fallback_shares() -> None:
    jan_31_end = 1_769_903_999_000  # 2026-01-31T23:59:59Z
    assert ms_to_next_month(jan_31_end) == 1000
    assert scaled(PlanLimits(10, 7, 1, 500), 3) == PlanLimits(3, 2, 1, None)
    assert scaled(PlanLimits(rpm=0), 3).rpm == 0
