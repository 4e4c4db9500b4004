"""`/healthz` (the process can serve) and `/readyz` (the bus works, replies are heard).

`/health` answers as `/healthz` does: vLLM's and trtllm-serve's name, which load testers probe.

In embedded mode (`sluice serve`) the engine worker runs in this process too: the
composition root puts a `WorkerProbe` on `app.state.worker_probe`, and both answers
include it. `/readyz` is 503 while the worker cannot take requests (its engine is being
restarted); `/healthz` is 503 once it stopped for good (the engine could not be
restarted), so a supervisor restarts the process.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from sluice.api.deps import Gateway, gateway

router = APIRouter(tags=["health"])


class WorkerProbe(Protocol):
    """The engine worker of this process, as the probes see it."""

    def ready(self) -> bool:
        """It holds partitions and its engine is up."""
        ...

    def healthy(self) -> bool:
        """It runs, or heals itself; False once it stopped."""
        ...

    def unavailable(self) -> str | None:
        """Why no engine is up, for a client's 503 (its engine died or failed to start,
        or the worker stopped); None while it is up or still loading."""
        ...


def _worker_probe(request: Request) -> WorkerProbe | None:
    probe: WorkerProbe | None = getattr(request.app.state, "worker_probe", None)
    return probe


@router.get("/healthz", response_model=None)
@router.get("/health", response_model=None)
async def healthz(request: Request) -> dict[str, str] | JSONResponse:
    probe = _worker_probe(request)
    if probe is not None and not probe.healthy():
        return JSONResponse({"status": "unhealthy", "engine_worker": "stopped"}, 503)
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(request: Request, gw: Gateway = Depends(gateway)) -> dict[str, Any] | JSONResponse:
    service = gw.service
    probe = _worker_probe(request)
    worker_ready = probe is None or probe.ready()
    ready = service.ready and worker_ready
    body: dict[str, Any] = {
        "status": "ready" if ready else "not ready",
        "gateway_id": service.gateway_id,
        "reply_topic": service.reply_topic,
        "reply_consumer": service.ready,
        "live_requests": service.num_live_requests,
    }
    if probe is not None:
        body["engine_worker"] = "ready" if worker_ready else "not ready"
    if not ready:
        return JSONResponse(body, status_code=503)
    return body
