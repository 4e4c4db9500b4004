"""The fault suite: each fault of `sluice bench faults` on a real fleet, at its goal.

Fewer requests per fault than the benchmark's 1,000 (CI runs on 2 cores); the same code.
Goal for every row: nothing lost, no duplicated or missing tokens at the clients, the
ledger equal to the engine's usage records and to the usage the clients were shown; a
graceful fault (the rolling restart) fails nothing and bills each completed request
exactly what its client got. The broker restart runs Tansu on an s3rver bucket
(`benchmarks.s3_storage`: node and npm, s3rver installed into a cache on first use).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.faults import FAULTS, render, run_fault
from benchmarks.s3_storage import S3rverMissing, ensure_s3rver
from tests.services import service_missing

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleet_services")]

REQUESTS = 300


# a row runs about a minute on 2 cores; slower cores need more than the 300 s default
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", [pytest.param(f, id=f.name) for f in FAULTS])
def test_fault(fault, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if fault.durable:  # the broker's storage is an s3rver bucket: node, npm and s3rver
        try:
            ensure_s3rver()
        except S3rverMissing as exc:
            service_missing(str(exc))
    row = run_fault(fault, REQUESTS, 16, tmp_path)
    table = render({"rows": [row]})
    print(f"{fault.name}: load {row['seconds']} s, settling {row['settle_seconds']} s\n{table}")
    assert row["sent"] >= REQUESTS  # more while a fault is still being injected
    assert row["lost"] == 0, table
    assert row["duplicated_tokens"] == 0 and row["missing_tokens"] == 0, table
    assert row["usage_mismatches"] == 0, table
    assert row["ledger_equals_engine"], table
    assert row["client_equals_ledger"], table  # what the clients were shown is what is billed
    if fault.graceful:  # nothing failed, nothing redone: billed exactly what clients got
        assert row["failed_clear"] == 0 and row["billed_not_delivered"] == 0, table
    assert not any("failed" in i or "never ran" in i for i in row["injected"]), table
