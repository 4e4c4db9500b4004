"""`GET /v1/usage`: the caller's own usage from the ledger (totals, by model, by day).

The tenant comes from the API key, never from a parameter, so a key sees only its own
tenant's rows (docs/architecture.md §5.6). `since`/`until` are UTC days, inclusive.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from sluice.api.auth import Principal, require_principal
from sluice.api.deps import Gateway, gateway
from sluice.api.errors import NotFound
from sluice.billing import admin
from sluice.storage.db import Database

router = APIRouter(prefix="/v1", tags=["usage"])


def tenancy_db(gw: Gateway) -> Database:
    if gw.admission is None:
        raise NotFound(
            "usage reports need the tenant store: run `sluice serve`, or set "
            "SLUICE_DATABASE_URL for `sluice gateway`",
            code="usage_unavailable",
        )
    return gw.admission.admission.auth.db


@router.get("/usage")
def get_usage(
    since: str | None = Query(None, description="First day, YYYY-MM-DD (UTC)."),
    until: str | None = Query(None, description="Last day, YYYY-MM-DD, inclusive."),
    principal: Principal = Depends(require_principal),
    gw: Gateway = Depends(gateway),
) -> dict[str, Any]:
    """Requests, tokens and cost of the caller's tenant, by model and by day."""
    db = tenancy_db(gw)
    report = admin.report(
        db,
        tenant=principal.tenant_id,
        since=admin.parse_day(since, "since"),
        until=admin.parse_day(until, "until"),
        by_id=True,
    )
    return {"object": "usage", **report.as_dict()}
