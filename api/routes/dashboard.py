"""`/dashboard`: the live operations page, and `/dashboard/data`, the JSON it polls.

The page (api/dashboard/dashboard.html) is a static shell with no data in it; its script
takes the admin key from the URL fragment (`/dashboard#key=…`, never sent to the server)
or a form, and polls `/dashboard/data` every 2 s with `Authorization: Bearer <admin key>`.
That endpoint checks the key as the admin API does (`require_admin`) and answers the
pipeline numbers (api/dashboard_data.py: this process's metrics and those of
`SLUICE_METRICS_PEERS`), tokens and spend per tenant today from the usage ledger, and the
batches in progress. Both stay out of the OpenAPI schema: they are not part of the API.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse
from prometheus_client import REGISTRY, CollectorRegistry
from starlette.datastructures import State

from sluice.api.dashboard_data import ScrapeHistory, scrape_all
from sluice.api.deps import Gateway, gateway
from sluice.api.errors import NotFound
from sluice.api.routes.admin import require_admin
from sluice.storage.batches import BatchStore
from sluice.storage.dashboard import batches_in_progress, tenant_usage_on
from sluice.storage.db import Database

router = APIRouter(tags=["dashboard"], include_in_schema=False)
PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "dashboard.html"
# Inline script and style only; the page fetches nothing but its own origin.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'none'; base-uri 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


@functools.cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse)
def dashboard_page() -> HTMLResponse:
    """The page's HTML shell: no data, no key needed (the data endpoint asks for it)."""
    return HTMLResponse(_page(), headers=PAGE_HEADERS)


def admin_database(request: Request, gw: Gateway = Depends(gateway)) -> Database | None:
    """The admin key checked (401/403 as the admin API); the billing database, or None on
    a gateway without the tenant store (the page then shows no tenant table)."""
    try:
        return require_admin(request, gw)
    except NotFound:  # raised only after the key matched
        return None


class DashboardState:
    """What the data endpoint keeps between polls: the scrapes of the last minutes."""

    def __init__(
        self,
        peers: list[str],
        transport: httpx.AsyncBaseTransport | None = None,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.peers = peers
        self.transport = transport  # tests put a fake one here
        self.registry = registry  # this process's metrics (tests: one of their own)
        self.history = ScrapeHistory()
        self.lock = asyncio.Lock()  # one scrape at a time, however many pages poll


def _state(app_state: State) -> DashboardState:
    state: DashboardState | None = getattr(app_state, "dashboard", None)
    if state is None:
        state = DashboardState(list(getattr(app_state, "metrics_peers", None) or []))
        app_state.dashboard = state
    return state


@router.get("/dashboard/data")
async def dashboard_data(
    request: Request, db: Database | None = Depends(admin_database)
) -> dict[str, Any]:
    """The page's numbers; a peer that cannot be scraped is listed in `sources`, not fatal."""
    state = _state(request.app.state)
    async with state.lock:
        scrapes, sources = await scrape_all(
            state.peers, registry=state.registry, transport=state.transport
        )
        state.history.add(time.monotonic(), scrapes)
        summary = state.history.summary()
    day = dt.datetime.now(dt.UTC).date()
    store: BatchStore | None = getattr(getattr(request.app.state, "batches", None), "store", None)
    tenants, batches = await asyncio.gather(
        asyncio.to_thread(_tenants, db, day), asyncio.to_thread(_batches, store)
    )
    return {
        "object": "dashboard",
        "now_ms": int(time.time() * 1000),
        "sources": [s.as_dict() for s in sources],
        **summary,
        "tenants": tenants,
        "batches": batches,
    }


def _tenants(db: Database | None, day: dt.date) -> dict[str, Any]:
    if db is None:
        return {"available": False, "day": day.isoformat(), "data": []}
    rows = tenant_usage_on(db, day)
    return {"available": True, "day": day.isoformat(), "data": [r.as_dict() for r in rows]}


def _batches(store: BatchStore | None) -> dict[str, Any]:
    if store is None:
        return {"available": False, "data": []}
    data = [
        {"id": b.id, "tenant_id": b.tenant_id, "model": b.model, "status": b.status,
         "total": b.total, "completed": b.completed, "failed": b.failed,
         "created_at": b.created_at}
        for b in batches_in_progress(store)
    ]  # fmt: skip
    return {"available": True, "data": data}
