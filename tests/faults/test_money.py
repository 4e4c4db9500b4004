"""The money suite (`sluice bench money --quick`): on every path, fault or not, Σ ledger
equals Σ usage the client was shown, to the token and to the pico-dollar.

`sluice serve` runs plain requests, `n` = 4, streams cancelled by disconnect, three
batches (completed, cancelled, expired), `sluice bulk` (against the engine's usage
records) and a kill -9 of the engine process; a `sluice up` fleet on Kafka runs plain
requests and kill -9s of an engine worker and of the gateway, mid-stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.money import render

pytestmark = pytest.mark.slow


def _check(rows: list[dict[str, Any]]) -> None:
    table = render({"rows": rows, "seconds": round(sum(r["seconds"] for r in rows), 1)})
    print(table)
    assert rows, "no scenario ran"
    off = [f"{r['scenario']}: diff {r['diff']}, unseen {r['unseen']}, notes {r['notes']}"
           for r in rows if not r["at_goal"]]  # fmt: skip
    assert not off, "\n".join(off) + "\n\n" + table


@pytest.mark.timeout(600)
def test_ledger_equals_what_clients_were_shown_on_serve(tmp_path: Path) -> None:
    from benchmarks import money_serve

    _check(money_serve.run(tmp_path, quick=True, only=None))


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("fleet_services")
def test_ledger_equals_what_clients_were_shown_on_kafka(tmp_path: Path) -> None:
    from benchmarks import money_fleet

    _check(money_fleet.run(tmp_path, quick=True, only=None))
