"""Bridges from a `Generation` to the client: SSE framing, disconnect watching, WebSocket.

- `SSEResponse` watches for the client going away while it streams (whatever the ASGI
  spec version), so a closed connection ends the generator at once and its `finally`
  publishes the Cancel.
- `until_disconnect` does the same for a non-streaming answer still being generated.
- `ws_session` runs the Responses WebSocket mode over one connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from api.errors import error_for_finish
from api.generation import ChoiceResult, Generation, StreamEvent

logger = logging.getLogger(__name__)
T = TypeVar("T")

DONE = "data: [DONE]\n\n"
PING = ": ping\n\n"
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """A named event (Responses streaming: `event: response.output_text.delta`)."""
    return f"event: {payload['type']}\n{sse_data(payload)}"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None):
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Always race the body against http.disconnect: with ASGI 2.4 Starlette would
        # only notice a gone client at the next write, and a quiet stream never writes.
        async with anyio.create_task_group() as tg:

            async def run_then_stop(func: Callable[[], Awaitable[None]]) -> None:
                await func()
                tg.cancel_scope.cancel()

            tg.start_soon(run_then_stop, partial(self.stream_response, send))
            await run_then_stop(partial(self.listen_for_disconnect, receive))


async def pump(generation: Generation, ping_s: float) -> AsyncIterator[StreamEvent | None]:
    """The generation's events; None whenever `ping_s` passed without one."""
    while generation.pending:
        yield await generation.next_event(ping_s)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(
    request: Request, generation: Generation, work: Awaitable[T]
) -> T | None:
    """`work`'s result, or None (and the generation cancelled) if the client left first."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        logger.info("client went away request_id=%s", generation.request_id)
        return None
    finally:
        for task in (work_task, watch):
            task.cancel()
        generation.abandon()


async def collect_answer(request: Request, generation: Generation) -> list[ChoiceResult] | None:
    """A non-streamed answer's choices; None if the client left first. A choice that
    ended in error, abort or deadline raises its OpenAI error."""
    results = await until_disconnect(request, generation, generation.collect())
    for result in results or []:
        error = error_for_finish(result.finish_reason or "error", result.error)
        if error is not None:
            raise error
    return results


# -- Responses WebSocket mode --------------------------------------------------------------
EventSource = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]


class WsSession:
    """One Responses WebSocket connection: `response.create` in, stream events out.

    Each `stream_id` (None included) is a lane whose creates run in order; lanes run
    side by side. When the socket closes, every running response is cancelled.
    """

    def __init__(self, websocket: WebSocket, source: EventSource) -> None:
        self._ws = websocket
        self._source = source
        self._send_lock = asyncio.Lock()
        self._lanes: dict[str | None, asyncio.Queue[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def send(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            await self._ws.send_text(json.dumps(event, separators=(",", ":"), ensure_ascii=False))

    async def run(self) -> None:
        try:
            while True:
                raw = await self._ws.receive_text()
                await self._dispatch(raw)
        except WebSocketDisconnect:
            pass
        finally:
            for task in self._tasks:
                task.cancel()  # each lane's finally cancels its running response
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _dispatch(self, raw: str) -> None:
        try:
            event = json.loads(raw)
        except ValueError:
            await self.send(ws_error(400, "the message is not valid JSON", "invalid_json"))
            return
        if not isinstance(event, dict) or event.get("type") != "response.create":
            kind = event.get("type") if isinstance(event, dict) else None
            await self.send(
                ws_error(
                    400,
                    f"unsupported event type {kind!r}; send response.create",
                    "unsupported_event",
                )
            )
            return
        lane_key = event.get("stream_id")
        lane_key = lane_key if isinstance(lane_key, str) else None
        queue = self._lanes.get(lane_key)
        if queue is None:
            queue = self._lanes[lane_key] = asyncio.Queue()
            self._tasks.append(asyncio.create_task(self._lane(queue)))
        queue.put_nowait(event)

    async def _lane(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            event = await queue.get()
            stream_id = event.get("stream_id")
            async for out in self._source(event):
                if stream_id is not None:
                    out = {**out, "stream_id": stream_id}
                await self.send(out)


def ws_error(
    status: int, message: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    error_type = "invalid_request_error" if status < 500 else "server_error"
    return {
        "type": "error",
        "status": status,
        "error": {"type": error_type, "code": code, "message": message, "param": param},
    }
