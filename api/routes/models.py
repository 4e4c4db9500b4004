"""`GET /v1/models`: the served models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from sluice.api.auth import require_principal
from sluice.api.deps import Gateway, gateway
from sluice.api.served import ServedModel

router = APIRouter(prefix="/v1", dependencies=[Depends(require_principal)], tags=["models"])


def _model(m: ServedModel) -> dict[str, Any]:
    return {
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": m.owned_by,
        "max_model_len": m.max_model_len,
    }


@router.get("/models")
async def list_models(gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    return {"object": "list", "data": [_model(m) for m in gw.models]}


@router.get("/models/{model:path}")
async def get_model(model: str, gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    return _model(gw.models.get(model))
