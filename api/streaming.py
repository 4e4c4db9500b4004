"""Bridges from a `Generation` to the client: SSE framing, disconnect watching, WebSocket.

- `SSEResponse` watches for the client going away while it streams (whatever the ASGI
  spec version), so a closed connection ends the generator at once and its `finally`
  publishes the Cancel.
- `until_disconnect` does the same for a non-streaming answer still being generated.
- `WsSession` runs the Responses WebSocket mode over one connection; `ws_refusal` says
  why a handshake is refused (an `Origin` outside the allow-list).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from sluice.api.errors import APIError, AuthenticationFailed, error_for_finish
from sluice.api.generation import ChoiceResult, Generation, StreamEvent
from sluice.api.schemas import invalid_unicode_at

logger = logging.getLogger(__name__)
T = TypeVar("T")

DONE = "data: [DONE]\n\n"
# A comment line without the blank line that ends an event: the openai SDK's decoder
# dispatches an empty event at a blank line once any event had an id (it keeps the last
# id, as the spec says) and then fails to parse its empty data as JSON.
PING = ": ping\n"
# set in the ASGI scope's state by the HTTP server when it closes a connection whose client
# stopped reading: a defence against slow readers, so its stream is not kept for a resume
SEND_STALLED = "send_stalled"
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def wire_json(payload: dict[str, Any]) -> str:
    """One event as compact JSON, the text of every SSE data line and WebSocket frame.

    ASCII only: clients that split lines like `str.splitlines` (httpx's `iter_lines`)
    break a raw U+0085, U+2028 or U+2029 in two. Escaping all non-ASCII costs less CPU
    than escaping just those three (no scan, and the UTF-8 encode is a copy), and a few
    bytes per non-ASCII character.
    """
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=True)


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {wire_json(payload)}\n\n"


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
        error = error_for_finish(result.finish_reason or "error", result.error, result.error_code)
        if error is not None:
            raise error
    return results


# -- Responses WebSocket mode --------------------------------------------------------------
# One event's source: the event and its call id (hex; its request id is `req_<hex>`).
EventSource = Callable[[dict[str, Any], str], AsyncIterator[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class _Work:
    """One event in a lane: run it through the source, or answer its `error`."""

    event: dict[str, Any]
    call_id: str
    error: dict[str, Any] | None = None


_Lane = deque[_Work]  # the events of one stream_id not yet run, in order

# RFC 6455 close codes
POLICY_VIOLATION = 1008
UNSUPPORTED_DATA = 1003
_MAX_REASON_BYTES = 123  # what a close frame's reason can hold


def ws_refusal(websocket: WebSocket) -> str | None:
    """Why this handshake is refused before authentication, or None.

    Browsers send `Origin`; one outside `app.state.ws_allowed_origins` is refused, so a
    page on another site cannot drive the API with a user's cookies or local network
    access. Other clients send no Origin and pass; an empty or absent list allows all.
    """
    allowed = getattr(websocket.app.state, "ws_allowed_origins", None)
    origin = websocket.headers.get("origin")
    if not allowed or origin is None:
        return None
    if _origin_key(origin) in {_origin_key(o) for o in allowed}:
        return None
    return f"origin {origin[:60]!r} is not allowed"


def _origin_key(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


async def refuse_handshake(websocket: WebSocket, reason: str) -> None:
    """Close before accepting: the server answers the handshake with HTTP 403.

    Not a denial response with a JSON body: uvicorn's default (sans-I/O) protocol logs
    each one as an ERROR "returned without completing handshake".
    """
    request_id = websocket.scope.get("state", {}).get("request_id")
    logger.info("websocket refused request_id=%s: %s", request_id, reason)
    await websocket.close(POLICY_VIOLATION, _close_reason(reason))


def _close_reason(reason: str) -> str:
    return reason.encode()[:_MAX_REASON_BYTES].decode(errors="ignore")


class WsSession:
    """One Responses WebSocket connection: `response.create` in, stream events out.

    Each `stream_id` (None included) is a lane whose creates run in order; lanes run
    side by side, and a lane ends (and is forgotten) once it has run what it was sent.
    A bad event gets an `error` event and its lane goes on to the next; a binary frame
    closes the socket (1003). At most `max_pending` events wait or run at once, over all
    lanes: one more gets an `error` event (`too_many_pending_events`) and is dropped, so
    a connection holds bounded state whatever it sends. A source that raises
    `AuthenticationFailed` (the key was revoked) gets its `error` event and the socket
    closes (1008). When the socket closes, every running response is cancelled.
    """

    def __init__(self, websocket: WebSocket, source: EventSource, max_pending: int = 64) -> None:
        self._ws = websocket
        self._source = source
        self._max_pending = max_pending
        self._num_pending = 0  # events queued or running, all lanes together
        self._send_lock = asyncio.Lock()
        self._lanes: dict[str | None, _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._request_id = websocket.scope.get("state", {}).get("request_id")

    async def send(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            await self._ws.send_text(wire_json(event))

    async def run(self) -> None:
        try:
            while True:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    logger.info("websocket binary frame request_id=%s: closing", self._request_id)
                    reason = "binary frames are not supported; send JSON text frames"
                    await self._ws.close(UNSUPPORTED_DATA, reason)
                    return
                await self._dispatch(text)
        except WebSocketDisconnect:
            pass
        finally:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()  # each lane's finally cancels its running response
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _dispatch(self, raw: str) -> None:
        try:
            event = json.loads(raw)
        except ValueError:
            await self.send(ws_error(400, "the message is not valid JSON", "invalid_json"))
            return
        if not isinstance(event, dict):
            await self.send(ws_error(400, "the message must be a JSON object", "invalid_json"))
            return
        # a lone surrogate (`"\ud800"`) fails later, in the tokenizer or when echoed back
        where = invalid_unicode_at(event)
        lane_key = event.get("stream_id")
        if not isinstance(lane_key, str) or invalid_unicode_at(lane_key) is not None:
            lane_key = None
        error = None
        if where is not None:
            message = f"{where} is not valid Unicode (it holds a lone surrogate)"
            error = ws_error(400, message, "invalid_value", where)
        elif event.get("type") != "response.create":
            message = f"unsupported event type {event.get('type')!r}; send response.create"
            error = ws_error(400, message, "unsupported_event")
        if self._num_pending >= self._max_pending:
            message = (
                f"this connection has {self._max_pending} response.create events waiting or"
                " running; wait for one to finish before sending another"
            )
            error = ws_error(429, message, "too_many_pending_events", None, "rate_limit_error")
            await self.send(_tagged(error, lane_key))
            return
        self._num_pending += 1
        # errors too go through the lane: a client reads its lane's answers in order
        work = _Work(event, uuid.uuid4().hex, error)
        lane = self._lanes.get(lane_key)
        if lane is not None:
            lane.append(work)
            return
        lane = self._lanes[lane_key] = deque([work])
        task = asyncio.create_task(self._lane(lane, lane_key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lane(self, lane: _Lane, key: str | None) -> None:
        """Run the lane's events in order; end, forgotten, when none is left."""
        try:
            while lane:  # no await between this check and the `finally`: nothing is lost
                work = lane.popleft()
                try:
                    if not await self._run(work, key):
                        return
                finally:
                    self._num_pending -= 1
        finally:
            del self._lanes[key]
            self._num_pending -= len(lane)

    async def _run(self, work: _Work, key: str | None) -> bool:
        """Answer one event; False when the socket is gone or being closed."""
        try:
            if work.error is not None:
                await self.send(_tagged(work.error, key))
                return True
            async for out in self._source(work.event, work.call_id):
                await self.send(_tagged(out, key))
        except WebSocketDisconnect:
            return False  # the reader sees the close and cancels the other lanes
        except AuthenticationFailed as exc:
            await self._close_unauthenticated(exc, key)
            return False
        except Exception as exc:
            # one event's failure answers that event, never the lane or the socket
            return await self._answer_failure(exc, work.call_id, key)
        return True

    async def _close_unauthenticated(self, exc: AuthenticationFailed, key: str | None) -> None:
        """The key stopped authenticating (revoked): say so, then close the socket."""
        logger.info("websocket closed request_id=%s: %s", self._request_id, exc.message)
        error = ws_error(exc.status_code, exc.message, exc.code, exc.param, exc.error_type)
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.send(_tagged(error, key))
            await self._ws.close(POLICY_VIOLATION, _close_reason(exc.message))

    async def _answer_failure(self, exc: Exception, call_id: str, key: str | None) -> bool:
        """Log and send an `error` event for a failed event; False if the socket is gone."""
        if isinstance(exc, APIError):
            logger.info("websocket event failed request_id=req_%s: %s", call_id, exc.message)
            error = ws_error(exc.status_code, exc.message, exc.code, exc.param)
        else:
            logger.exception(
                "websocket event failed request_id=req_%s connection=%s",
                call_id,
                self._request_id,
            )
            message = f"the server failed to handle this event (request id req_{call_id})"
            error = ws_error(500, message, "server_error")
        try:
            await self.send(_tagged(error, key))
        except (WebSocketDisconnect, RuntimeError):  # closed meanwhile
            return False
        return True


def _tagged(event: dict[str, Any], stream_id: str | None) -> dict[str, Any]:
    return event if stream_id is None else {**event, "stream_id": stream_id}


def ws_error(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    error_type: str | None = None,
) -> dict[str, Any]:
    if error_type is None:
        error_type = "invalid_request_error" if status < 500 else "server_error"
    return {
        "type": "error",
        "status": status,
        "error": {"type": error_type, "code": code, "message": message, "param": param},
    }
