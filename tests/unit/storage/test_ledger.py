"""The usage ledger on a real SQLite file: unpriced usage is recorded, and said once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sluice.storage.db import Database, make_engine, migrate
from sluice.storage.ledger import UsageLedger
from sluice.storage.prices import PriceBook
from tests.integration.billing.usage_data import make_usages


def test_an_unpriced_model_warns_once_however_many_rows_it_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'sluice.db'}")
    migrate(engine)
    db = Database(engine)
    PriceBook(db).set("priced", input_usd="1", cached_input_usd="0.5", output_usd="2")
    # model names of this test only: the ledger remembers what it warned about per process
    unpriced = f"unpriced-{tmp_path.name}", f"other-unpriced-{tmp_path.name}"
    usages = [
        u.model_copy(update={"model": (*unpriced, "priced")[i % 3]})
        for i, u in enumerate(make_usages(90))
    ]
    ledger = UsageLedger(db)
    with caplog.at_level(logging.WARNING, logger="storage.ledger"):
        # three consumer batches, every row recorded
        assert sum(ledger.record(usages[start : start + 30]) for start in range(0, 90, 30)) == 90
    db.close()
    warned = [r for r in caplog.records if r.getMessage().startswith("no price for model=")]
    assert [r.args[0] for r in warned if isinstance(r.args, tuple)] == list(unpriced)
    assert "sluice prices set" in warned[0].getMessage()
