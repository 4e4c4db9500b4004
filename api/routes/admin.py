"""`/admin/v1`: tenants (their limits and allowed models), keys, LoRA adapters, usage
reports and the price book, behind the admin key.

The same operations as `sluice tenants|keys|billing|prices` (`billing.admin`). The admin
key is `SLUICE_ADMIN_KEY`, sent as `Authorization: Bearer <key>`. Without one configured
every admin route answers 403 `admin_disabled`; a wrong or missing key is 401.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from sluice.api.auth import bearer_token
from sluice.api.deps import Gateway, gateway
from sluice.api.errors import AuthenticationFailed, PermissionDenied
from sluice.api.routes.usage import tenancy_db
from sluice.billing import admin
from sluice.storage.db import Database


def require_admin(request: Request, gw: Gateway = Depends(gateway)) -> Database:
    """The billing database, for a caller holding the admin key."""
    check_admin_key(request, gw)
    return tenancy_db(gw)


def check_admin_key(request: Request, gw: Gateway) -> None:
    """403 without an admin key configured, 401 unless the caller sends it."""
    if not gw.admin_key:
        raise PermissionDenied(
            "the admin API is disabled: set SLUICE_ADMIN_KEY on the gateway to enable it",
            code="admin_disabled",
        )
    token = bearer_token(request) or ""
    if not hmac.compare_digest(token.encode(), gw.admin_key.encode()):
        raise AuthenticationFailed("incorrect admin key provided")


router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(require_admin)])
Row = dict[str, Any]


# Amounts as strings keep their exact decimals; JSON numbers are taken too
Amount = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int | float) else v)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantCreate(_Body):
    name: str
    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    max_concurrency: int | None = Field(None, ge=0)
    monthly_budget_usd: Amount | None = None
    allowed_models: list[str] | None = Field(
        None, description="Served names its keys may use (models, aliases, adapters); null: all."
    )


class AllowedModels(_Body):
    allowed_models: list[str] | None = Field(
        description="Served names its keys may use (models, aliases, adapters); null: all."
    )


class KeyCreate(_Body):
    tenant: str = Field(description="Tenant name or id.")
    name: str | None = None


class PriceSet(_Body):
    model: str
    input_usd: Amount
    cached_input_usd: Amount
    output_usd: Amount
    batch_discount: Amount = "0"


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantCreate, db: Database = Depends(require_admin)) -> Row:
    """A tenant with its limits and a first key; `api_key` is shown only in this answer."""
    return admin.create_tenant(
        db, body.name, rpm=body.rpm, tpm=body.tpm, max_concurrency=body.max_concurrency,
        monthly_budget_usd=body.monthly_budget_usd, allowed_models=body.allowed_models,
    )  # fmt: skip


@router.get("/tenants")
def list_tenants(db: Database = Depends(require_admin)) -> Row:
    return {"object": "list", "data": admin.list_tenants(db)}


@router.put("/tenants/{tenant}/models")
def set_allowed_models(
    tenant: str,
    body: AllowedModels,
    db: Database = Depends(require_admin),
    gw: Gateway = Depends(gateway),
) -> Row:
    """Replace what the tenant may use: at once on this gateway, on the others as their
    auth caches let its keys go (5 s)."""
    row = admin.set_allowed_models(db, tenant, body.allowed_models)
    if gw.admission is not None:
        gw.admission.admission.auth.invalidate()
    return row


@router.get("/adapters")
def list_adapters(
    tenant: str | None = Query(None, description="Only those this tenant sees (name or id)."),
    db: Database = Depends(require_admin),
) -> Row:
    """LoRA adapters loaded at run time (those of `--lora` are in the gateway's settings)."""
    return {"object": "list", "data": admin.list_adapters(db, tenant)}


@router.post("/keys", status_code=201)
def create_key(body: KeyCreate, db: Database = Depends(require_admin)) -> Row:
    return admin.create_key(db, body.tenant, body.name)


@router.get("/keys")
def list_keys(tenant: str | None = None, db: Database = Depends(require_admin)) -> Row:
    return {"object": "list", "data": admin.list_keys(db, tenant)}


@router.post("/keys/{key_id}/revoke")
def revoke_key(key_id: str, db: Database = Depends(require_admin)) -> Row:
    return admin.revoke_key(db, key_id)


@router.get("/usage")
def usage(
    tenant: str | None = Query(None, description="Tenant name or id (default: all)."),
    since: str | None = None,
    until: str | None = None,
    db: Database = Depends(require_admin),
) -> Row:
    report = admin.report(
        db, tenant=tenant, since=admin.parse_day(since, "since"),
        until=admin.parse_day(until, "until"),
    )  # fmt: skip
    return {"object": "usage", **report.as_dict()}


@router.put("/prices", status_code=200)
def set_price(body: PriceSet, db: Database = Depends(require_admin)) -> Row:
    return admin.set_price(
        db, body.model, input_usd=body.input_usd, cached_input_usd=body.cached_input_usd,
        output_usd=body.output_usd, batch_discount=body.batch_discount,
    )  # fmt: skip


@router.get("/prices")
def list_prices(db: Database = Depends(require_admin)) -> Row:
    return {"object": "list", "data": admin.list_prices(db)}
