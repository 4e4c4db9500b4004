"""`sluice bench structured`'s pure parts: percentiles, output checks, the table."""

from __future__ import annotations

import json

from benchmarks.schemas import SCHEMAS, by_name
from benchmarks.structured import check_output, cycle_cases, latency_summary, render, validity


def test_latency_summary_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert latency_summary(values) == {"p50_ms": 50.0, "p99_ms": 99.0, "max_ms": 100.0}
    assert latency_summary([2.0]) == {"p50_ms": 2.0, "p99_ms": 2.0, "max_ms": 2.0}


def test_cycle_cases_cycles_the_suite() -> None:
    cases = cycle_cases(len(SCHEMAS) + 2)
    assert cases[0] is cases[len(SCHEMAS)] is SCHEMAS[0] and cases[-1] is SCHEMAS[1]


def test_validity_counts_cut_outputs_apart() -> None:
    case = by_name("sentiment")
    good = json.dumps(case.example)
    texts = [good, '{"label": "angry", "score": 0.5}', "{", '{"label": "pos']
    finishes = ["stop", "stop", "stop", "length"]
    v = validity(texts, finishes, [case] * 4)
    assert (v["outputs"], v["valid"], v["cut_at_max_tokens"]) == (4, 1, 1)
    assert v["valid_fraction"] == 0.25 and v["valid_fraction_of_finished"] == 0.3333
    assert [f["why"].split(":")[0] for f in v["failures"]] == ["invalid", "not JSON"]
    assert check_output(good, case.schema) is None


def test_render_shows_ratio_validity_and_compile_times() -> None:
    figures = {"tokens_per_s": 100.0, "ttft_ms": 12.0, "generated_tokens": 500}
    summary = {"p50_ms": 1.0, "p99_ms": 9.0, "max_ms": 9.5}
    validity_figures = validity(['{"label":"neutral","score":0}'], ["stop"], [by_name("sentiment")])
    result = {
        "model": "m",
        "mixed": {
            "systems": {"unconstrained": figures, "constrained": {**figures, "tokens_per_s": 97.0}},
            "ratio_constrained_vs_unconstrained": 0.97,
            "requests": 16,
            "reps": 1,
            "validity": validity_figures,
        },
        "compile": {
            "schemas": 65,
            "tokenizer_setup_ms": 300.0,
            "cold": summary,
            "cached": summary,
            "slowest_cold": "resume",
        },
        "vllm": {"skipped": "not installed"},
    }
    table = render(result)
    assert "sluice constrained" in table and "97.0" in table and "0.97x" in table
    assert "valid JSON (sluice): 1/1 = 1.0" in table
    assert "cold    p50 1.0 ms  p99 9.0 ms" in table
    assert "vllm skipped: not installed" in table
