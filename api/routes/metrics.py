"""`GET /metrics`: this process's Prometheus metrics (`tracing.metrics`), no auth as in vLLM.

On the gateway's API port: in `sluice serve` that includes the engine worker and the
side consumers of the process; `sluice up`'s workers serve their own on
`SLUICE_METRICS_PORT`. Left out of the OpenAPI schema: it is not part of the API.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

import sluice.tracing.metrics  # noqa: F401  (defines the metrics, so a fresh process shows them all)

router = APIRouter(tags=["metrics"], include_in_schema=False)


@router.get("/metrics")
def metrics() -> Response:
    # a plain `def`: FastAPI runs it on a thread, so a large registry never blocks the loop
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
