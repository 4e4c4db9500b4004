"""The outermost ASGI layer: a request id on every request, and the body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched. The id is `req_<hex>`, sent back as `x-request-id` on every response,
errors included, and used as the request id on the bus. The admission decision's
`x-ratelimit-*` headers, left on the scope state by `api.tenancy`, go on the response too.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import RequestTooLarge, error_response
from api.tenancy import RATELIMIT_STATE


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_id = f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers.append("x-request-id", request_id)
                for name, value in scope["state"].get(RATELIMIT_STATE, {}).items():
                    if name not in headers:
                        headers.append(name, value)
            await send(message)

        too_large = RequestTooLarge(f"the request body is larger than {self.max_body_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_body_bytes:
                await error_response(too_large, request_id)(scope, receive, send)
                return
            await self.app(scope, receive, send_with_id)
            return
        # no length (chunked): read the body here, within the limit, then replay it
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await error_response(too_large, request_id)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_id)
