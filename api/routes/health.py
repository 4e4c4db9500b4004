"""`/healthz` (the process answers) and `/readyz` (the bus works, replies are heard)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from api.deps import Gateway, gateway

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(gw: Gateway = Depends(gateway)) -> dict[str, Any] | JSONResponse:
    service = gw.service
    body = {
        "status": "ready" if service.ready else "not ready",
        "gateway_id": service.gateway_id,
        "reply_topic": service.reply_topic,
        "reply_consumer": service.ready,
        "live_requests": service.num_live_requests,
    }
    if not service.ready:
        return JSONResponse(body, status_code=503)
    return body
