"""`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`: LoRA adapters at run time,
in vLLM's shape, behind the admin key (as `/admin/v1`; disabled without SLUICE_ADMIN_KEY).

A load checks the directory (a PEFT `adapter_config.json` and `.safetensors` weights),
that its base model is served here and that no model, alias or adapter has the name,
then registers it in the tenant store: this gateway serves it at once, every other on
the database within its catalog's refresh (`api.served.ModelCatalog`). The engine
workers load the directory when a request first names the adapter, so the path must
be the same on them. `tenant_id` makes it private: listed and served to that tenant
alone. As vLLM, success is 200 with a line of plain text; errors are OpenAI error
objects (400 a bad directory, base or taken name; 404 an unknown adapter or tenant).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from sluice.api.deps import Gateway, gateway
from sluice.api.errors import InvalidRequest, NotFound
from sluice.api.routes.admin import check_admin_key
from sluice.billing import admin
from sluice.storage.db import Database
from sluice.storage.errors import Conflict


def require_admin(request: Request, gw: Gateway = Depends(gateway)) -> Database:
    """The tenant store, which holds the adapters every gateway serves, for the admin."""
    check_admin_key(request, gw)
    if gw.admission is None:
        raise NotFound(
            "LoRA adapters are loaded at run time into the tenant store: run `sluice serve`,"
            " or set SLUICE_DATABASE_URL for `sluice gateway` (or serve them with --lora)",
            code="adapters_unavailable",
        )
    return gw.admission.admission.auth.db


router = APIRouter(prefix="/v1", tags=["admin"], dependencies=[Depends(require_admin)])


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="The name requests send as `model`.")
    lora_path: str = Field(description="The PEFT adapter directory, as the workers see it.")
    base_model: str | None = Field(None, description="Its base model; default: the first served.")
    tenant_id: str | None = Field(None, description="Private to this tenant (name or id).")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = Field(None, description="Accepted for vLLM's clients; unused.")


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(
    body: LoadLoraAdapter,
    db: Database = Depends(require_admin),
    gw: Gateway = Depends(gateway),
) -> PlainTextResponse:
    name = body.lora_name
    base = body.base_model or gw.models.default_base
    if base is None or not gw.models.has_base(base):
        raise InvalidRequest(f"the base model '{base}' is not served here", param="base_model")
    if gw.models.taken(name):
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded, or a model has its name.",
            param="lora_name",
        )
    try:
        await asyncio.to_thread(admin.load_adapter, db, name, body.lora_path, base, body.tenant_id)
    except Conflict as exc:  # loaded by another gateway since this one's last refresh
        raise InvalidRequest(str(exc), param="lora_name") from exc
    await _refresh(gw)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(
    body: UnloadLoraAdapter,
    db: Database = Depends(require_admin),
    gw: Gateway = Depends(gateway),
) -> PlainTextResponse:
    name = body.lora_name
    if gw.models.started_with(name):
        raise InvalidRequest(
            f"'{name}' is served from the gateway's settings (--lora, SLUICE_LORA_MODULES"
            " or SLUICE_MODEL_ALIASES): remove it there",
            param="lora_name",
        )
    await asyncio.to_thread(admin.unload_adapter, db, name)
    await _refresh(gw)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _refresh(gw: Gateway) -> None:
    """This gateway serves the change from its answer on (the others at their refresh)."""
    await asyncio.to_thread(gw.models.refresh)
