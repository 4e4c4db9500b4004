"""`sluice bench money`: Σ ledger against Σ usage the client was shown, one row per path.

The promise to a tenant (issue 33): what the ledger bills equals the usage the client
was shown, on every path, fault or not. Per request that is its prompt once, every
completion token the client was sent once however many attempts it took, and, for a
client that hung up before its usage arrived, the tokens generated before the abort,
which `/v1/usage` shows it. Recomputation after a failover is the operator's cost.

Each scenario runs under a tenant of its own, so its ledger is that tenant's
`/v1/usage` totals. Its client-visible side sums, per request:

- the `usage` object of the response (unary), of the last chunk (streams with
  `include_usage`), or of the output and error lines (batches; `batch.usage` is
  compared too);
- for a request whose client never saw a usage object (a stream it hung up on, one cut
  by a gateway kill), the ledger's own rows for that request: what `/v1/usage` shows
  it. Those rows must bill at least the completion tokens the client received.

Costs are the price book's (`PRICE`, set through the admin API), per request, the
batch lane at its discount; the ledger's are the cost it recorded. `sluice bulk` has no
ledger: its output lines are compared with the engine's usage records instead.

The goal in every row: difference 0 tokens and 0 cost (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sluice.storage.prices import Price

MODEL = "tiny-llama"
# Whole micro-dollars per million tokens, batch at half price: every cost is an exact
# integer of pico-dollars, so a difference of one token shows as a difference in cost.
PRICE = Price(MODEL, input_micros=1_000_000, cached_input_micros=500_000,
              output_micros=2_000_000, batch_discount_bp=5_000)  # fmt: skip
PRICE_BODY = {"model": MODEL, "input_usd": "1", "cached_input_usd": "0.5", "output_usd": "2",
              "batch_discount": "0.5"}  # fmt: skip
PICOS_PER_USD = 10**12
TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")


# -- sums ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Tally:
    """Σ tokens and cost of some requests (or, for a ledger, of its rows)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_picos: int = 0

    def add(self, prompt: int, cached: int, completion: int, cost_picos: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion
        self.cost_picos += cost_picos

    def add_usage(self, usage: Mapping[str, Any], *, batch: bool = False) -> None:
        """One request's usage object as the client got it, priced by the price book."""
        prompt, cached, completion = usage_tokens(usage)
        self.add(prompt, cached, completion,
                 PRICE.cost_picos(prompt, cached, completion, batch=batch))  # fmt: skip

    def __add__(self, other: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cost_usd": usd(self.cost_picos)}


def _values(t: Tally) -> tuple[int, ...]:
    return (t.requests, t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.cost_picos)


def usage_tokens(usage: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt, cached, completion) of a usage object: chat and completions name them
    `prompt_tokens`/`completion_tokens`, the Responses API and `batch.usage`
    `input_tokens`/`output_tokens`; cached tokens sit in the `*_details`."""
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return usage["input_tokens"], details.get("cached_tokens") or 0, usage["output_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    return usage["prompt_tokens"], details.get("cached_tokens") or 0, usage["completion_tokens"]


def usd(picos: int) -> str:
    return format(Decimal(picos) / PICOS_PER_USD, "f")


def picos(cost_usd: str) -> int:
    return int(Decimal(cost_usd) * PICOS_PER_USD)


def ledger_totals(report: Mapping[str, Any]) -> Tally:
    """The totals of a usage report (`/v1/usage`, `sluice billing report --format json`)."""
    t = report["totals"]
    return Tally(t["requests"], t["prompt_tokens"], t["cached_tokens"], t["completion_tokens"],
                 picos(t["cost_usd"]))  # fmt: skip


# -- what one scenario's clients saw ----------------------------------------------------------
@dataclass(slots=True)
class Seen:
    """One request from its client's side."""

    request_id: str | None = None
    usage: dict[str, Any] | None = None  # the usage object shown; None: never arrived
    received: int = 0  # completion tokens the client was sent
    batch: bool = False  # the batch lane: priced at its discount
    error: str | None = None


_CHOICE_SUFFIX = re.compile(r"-\d+$")


def base_request_id(ledger_request_id: str) -> str:
    """A ledger row's request: `n` > 1 bills each choice as `<request_id>-<i>`."""
    return _CHOICE_SUFFIX.sub("", ledger_request_id)


@dataclass(frozen=True, slots=True)
class LedgerRow:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_picos: int


def client_visible(seen: Iterable[Seen], rows: Iterable[LedgerRow]) -> tuple[Tally, dict[str, int]]:
    """Σ usage the clients were shown: their usage objects, and for a request that never
    got one, its own ledger rows (what `/v1/usage` shows it). Also, for those unseen
    requests: how many, the completion tokens their clients received and were billed."""
    by_request: dict[str, list[LedgerRow]] = {}
    for row in rows:
        by_request.setdefault(base_request_id(row.request_id), []).append(row)
    tally, unseen = Tally(), {"requests": 0, "received": 0, "billed": 0, "underbilled": 0}
    for s in seen:
        if s.usage is not None:
            tally.add_usage(s.usage, batch=s.batch)
            continue
        own = by_request.get(s.request_id or "", [])
        if not own and not s.received:
            continue  # refused before it ran (no id, nothing generated, nothing billed)
        billed = sum(r.completion_tokens for r in own)
        tally.add(sum(r.prompt_tokens for r in own), sum(r.cached_tokens for r in own), billed,
                  sum(r.cost_picos for r in own))  # fmt: skip
        unseen["requests"] += 1
        unseen["received"] += s.received
        unseen["billed"] += billed
        unseen["underbilled"] += int(billed < s.received)
    return tally, unseen


def difference(client: Tally, ledger: Tally) -> dict[str, int]:
    """Ledger minus client-visible, per token kind and in pico-dollars."""
    diff = {f: getattr(ledger, f) - getattr(client, f) for f in TOKEN_FIELDS}
    diff["cost_picos"] = ledger.cost_picos - client.cost_picos
    return diff


@dataclass(slots=True)
class Row:
    """One scenario: Σ client-visible, Σ ledger, and the difference."""

    scenario: str
    client: Tally
    ledger: Tally
    against: str = "ledger (/v1/usage)"  # what the right-hand side is
    unseen: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    extra_ok: bool = True  # a further check of the scenario held (e.g. batch.usage)

    @property
    def diff(self) -> dict[str, int]:
        return difference(self.client, self.ledger)

    @property
    def at_goal(self) -> bool:
        return (
            not any(self.diff.values())
            and not self.unseen.get("underbilled")
            and self.extra_ok
            and self.client.requests > 0
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "requests": self.client.requests,
            "client": self.client.as_dict(),
            "ledger": self.ledger.as_dict(),
            "against": self.against,
            "diff": {**self.diff, "cost_usd": usd(self.diff["cost_picos"])},
            "unseen": self.unseen,
            "at_goal": self.at_goal,
            "notes": self.notes,
            "seconds": round(self.seconds, 1),
        }


def failed_row(scenario: str, exc: BaseException, seconds: float) -> dict[str, Any]:
    """A scenario that could not run: reported, not hidden, never at goal."""
    row = Row(scenario, Tally(), Tally(), notes=[f"did not run: {exc!r}"[:400]], seconds=seconds)
    return row.as_dict()


# -- the run ----------------------------------------------------------------------------------
Scenario = Callable[[], list[Row]]


def run(quick: bool = False, only: list[str] | None = None, workdir: Path | None = None,
        fleet: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every scenario's rows: `sluice serve` ones first, then the Kafka fleet's."""
    from benchmarks import money_serve

    root = workdir or Path(tempfile.mkdtemp(prefix="sluice-money-"))
    started = time.monotonic()
    rows = money_serve.run(root / "serve", quick=quick, only=only)
    if fleet:
        from benchmarks import money_fleet

        rows += money_fleet.run(root / "fleet", quick=quick, only=only)
    return {"quick": quick, "seconds": round(time.monotonic() - started, 1), "price": PRICE_BODY,
            "rows": rows}  # fmt: skip


def wanted(name: str, only: list[str] | None) -> bool:
    return not only or any(o.lower() in name.lower() for o in only)


def render(result: dict[str, Any]) -> str:
    head = ("| scenario | requests | client prompt / cached / completion | client cost | "
            "ledger prompt / cached / completion | ledger cost | diff tokens | diff cost | "
            "at goal |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    for r in result["rows"]:
        c, ledger, d = r["client"], r["ledger"], r["diff"]
        lines.append(
            f"| {r['scenario']} | {r['requests']} | {_tokens(c)} | {c['cost_usd']} | "
            f"{_tokens(ledger)} | {ledger['cost_usd']} | {_tokens(d, signed=True)} | "
            f"{d['cost_usd']} | {'yes' if r['at_goal'] else 'NO'} |"
        )
    for r in result["rows"]:
        unseen = r["unseen"]
        detail = [f"{r['seconds']} s", f"right side: {r['against']}"]
        if unseen.get("requests"):
            detail.append(
                f"{unseen['requests']} without a usage object: received {unseen['received']}, "
                f"billed {unseen['billed']} completion tokens"
            )
        lines.append(f"- {r['scenario']}: " + "; ".join(detail + r["notes"]))
    lines.append(f"total {result['seconds']} s")
    return "\n".join(lines)


def _tokens(t: Mapping[str, Any], signed: bool = False) -> str:
    fmt = "{:+d}" if signed else "{:d}"
    return " / ".join(fmt.format(t[f]) for f in TOKEN_FIELDS)
