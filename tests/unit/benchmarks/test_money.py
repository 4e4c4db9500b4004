"""The money suite's sums: client-visible usage against the ledger, the difference, the table."""

from __future__ import annotations

from benchmarks.money import (
    LedgerRow,
    Row,
    Seen,
    Tally,
    base_request_id,
    client_visible,
    difference,
    ledger_totals,
    render,
    usage_tokens,
)


def chat_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, object]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def test_usage_objects_of_every_endpoint_read_the_same() -> None:
    assert usage_tokens(chat_usage(10, 5, 4)) == (10, 4, 5)
    batch = {"input_tokens": 10, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 4}}
    assert usage_tokens(batch) == (10, 4, 5)
    assert usage_tokens({"prompt_tokens": 3, "completion_tokens": 1}) == (3, 0, 1)


def test_a_usage_is_priced_by_the_book_and_the_batch_lane_at_half() -> None:
    tally = Tally()
    tally.add_usage(chat_usage(10, 5, 4))  # 6 x $1 + 4 x $0.5 + 5 x $2 per 1M tokens
    assert tally.cost_picos == 6_000_000 + 4 * 500_000 + 5 * 2_000_000 == 18_000_000
    tally.add_usage(chat_usage(10, 5, 4), batch=True)
    assert tally.cost_picos == 18_000_000 + 9_000_000
    assert (tally.requests, tally.prompt_tokens, tally.completion_tokens) == (2, 20, 10)


def test_ledger_totals_read_a_usage_report_to_the_pico_dollar() -> None:
    report = {"totals": {"requests": 3, "prompt_tokens": 30, "cached_tokens": 2,
                         "completion_tokens": 9, "cost_usd": "0.000049"}}  # fmt: skip
    assert ledger_totals(report) == Tally(3, 30, 2, 9, 49_000_000)


def test_choices_bill_under_their_request() -> None:
    assert base_request_id("req_ab12-3") == "req_ab12"
    assert base_request_id("req_ab12") == "req_ab12"
    assert base_request_id("req_9f_12-0") == "req_9f_12"  # a batch line's first choice


def test_a_request_without_usage_counts_its_own_ledger_rows() -> None:
    seen = [
        Seen("req_a", chat_usage(10, 5)),
        Seen("req_b", None, received=3),  # hung up after 3 tokens
        Seen(None, None),  # refused before it ran
    ]
    rows = [
        LedgerRow("req_a", 10, 0, 5, 20_000_000),
        LedgerRow("req_b", 8, 0, 6, 20_000_000),
        LedgerRow("req_b-1", 0, 0, 2, 4_000_000),
        LedgerRow("req_other", 1, 0, 1, 3_000_000),  # no request of these clients
    ]
    client, unseen = client_visible(seen, rows)
    assert client == Tally(2, 18, 0, 13, 44_000_000)
    assert unseen == {"requests": 1, "received": 3, "billed": 8, "underbilled": 0}
    _, unseen = client_visible([Seen("req_b", None, received=9)], rows)
    assert unseen["underbilled"] == 1  # the client got more than was billed


def test_difference_is_ledger_minus_client_and_the_row_is_at_goal_only_at_zero() -> None:
    client, ledger = Tally(2, 20, 0, 10, 40), Tally(3, 30, 0, 10, 50)
    assert difference(client, ledger) == {
        "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 0, "cost_picos": 10,
    }  # fmt: skip
    assert not Row("n", client, ledger).at_goal
    # a ledger with more rows (attempts) than requests is fine: only tokens and cost count
    assert Row("ok", client, Tally(5, 20, 0, 10, 40)).at_goal
    assert not Row("empty", Tally(), Tally()).at_goal  # a scenario that ran nothing
    assert not Row("under", client, client, unseen={"underbilled": 1}).at_goal
    assert not Row("batch", client, client, extra_ok=False).at_goal


def test_render_prints_each_row_with_its_difference() -> None:
    rows = [Row("plain", Tally(2, 20, 0, 10, 40_000_000), Tally(2, 20, 0, 10, 40_000_000)),
            Row("n4", Tally(1, 4, 0, 8, 1), Tally(4, 16, 0, 8, 1))]  # fmt: skip
    text = render({"rows": [r.as_dict() for r in rows], "seconds": 1.0})
    lines = text.splitlines()
    assert lines[2].startswith("| plain | 2 | 20 / 0 / 10 | 0.00004 |")
    assert lines[2].endswith("| +0 / +0 / +0 | 0 | yes |")
    assert lines[3].endswith("| +12 / +0 / +0 | 0 | NO |")
