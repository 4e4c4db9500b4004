"""The outermost ASGI layer: a request id on every request, and the body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched. The id is `req_<hex>`, sent back as `x-request-id` on every response,
errors included, and used as the request id on the bus. The admission decision's
`x-ratelimit-*` headers, left on the scope state by `api.tenancy`, go on the response too.
File uploads (`POST /v1/files`) have their own, larger body limit: a batch input file.
"""

from __future__ import annotations

import uuid
from collections import deque

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.errors import RequestTooLarge, error_response
from sluice.api.tenancy import RATELIMIT_STATE

UPLOAD_PATH = "/v1/files"


class GatewayMiddleware:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, max_upload_bytes: int | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max(max_upload_bytes or 0, max_body_bytes)

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

        limit = self.max_body_bytes
        if scope["method"] == "POST" and scope["path"] == UPLOAD_PATH:
            limit = self.max_upload_bytes
        too_large = RequestTooLarge(f"the request body is larger than {limit} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                await error_response(too_large, request_id)(scope, receive, send)
                return
            await self.app(scope, receive, send_with_id)
            return
        # no length (chunked): read the body here, within the limit, then replay it
        chunks: deque[bytes] = deque()
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await error_response(too_large, request_id)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        if not chunks:
            chunks.append(b"")

        async def replay() -> Message:
            # chunk by chunk, each dropped once handed on: an upload is never held twice
            if chunks:
                body = chunks.popleft()
                return {"type": "http.request", "body": body, "more_body": bool(chunks)}
            return await receive()

        await self.app(scope, replay, send_with_id)
