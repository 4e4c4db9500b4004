"""`GET /v1/models`: the models, aliases and LoRA adapters the caller may use.

Entries as vLLM's model cards: `root` is an alias's target, an adapter's directory, a
model's own name; an adapter's `parent` is its base model. A private adapter is
`owned_by` its tenant. What the caller may not use is missing here and 404 on
`GET /v1/models/{id}`, as a name that does not exist.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from sluice.api.auth import Principal, require_principal
from sluice.api.deps import Gateway, gateway
from sluice.api.served import Listed

router = APIRouter(prefix="/v1", dependencies=[Depends(require_principal)], tags=["models"])


def _card(entry: Listed) -> dict[str, Any]:
    m = entry.model
    return {
        "id": entry.id,
        "object": "model",
        "created": m.created,
        "owned_by": m.owned_by,
        "root": entry.root,
        "parent": entry.parent,
        "max_model_len": m.max_model_len,
    }


@router.get("/models")
async def list_models(
    principal: Principal = Depends(require_principal), gw: Gateway = Depends(gateway)
) -> dict[str, Any]:
    return {"object": "list", "data": [_card(e) for e in gw.models.listed(principal)]}


@router.get("/models/{model:path}")
async def get_model(
    model: str, principal: Principal = Depends(require_principal), gw: Gateway = Depends(gateway)
) -> dict[str, Any]:
    return _card(gw.models.entry(model, principal))
