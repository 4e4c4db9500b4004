"""What routes need from the app, as FastAPI dependencies."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from api.prepare import Limits
from api.served import ModelCatalog
from api.service import GatewayService


@dataclass(frozen=True, slots=True)
class Gateway:
    """The app's collaborators, stored on `app.state.gateway` by `create_app`."""

    service: GatewayService
    models: ModelCatalog
    limits: Limits
    sse_ping_s: float


def gateway(conn: HTTPConnection) -> Gateway:
    state: Gateway = conn.app.state.gateway
    return state


def call_id(conn: HTTPConnection) -> str:
    """The hex part of this request's x-request-id (`req_<hex>`)."""
    request_id: str = conn.scope["state"]["request_id"]
    return request_id.removeprefix("req_")
