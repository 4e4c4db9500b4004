"""The gateway's HTTP server: uvicorn with the deadlines and size limits a public port needs.

Where it sits: `sluice serve` and `sluice gateway` hand the FastAPI app to `build_server`.

uvicorn (0.54) bounds none of these on its own: a new connection may take forever to
send its request head, a head may be any size with httptools (h11's size limit applies
only with http="h11"), and a body may trickle in for ever. `GuardedHttpToolsProtocol`
keeps httptools' C parser (what uvicorn picks by default, and the faster one for the
streaming gateway) and adds:

- a head deadline (`header_timeout_s`) from the connection's start, or from a request's
  first byte on a kept-alive connection, to the end of its headers;
- a body deadline (`body_timeout_s`) from the end of the headers to the end of the body;
- a head size limit (`max_header_bytes`): counted as the bytes arrive, so an 8 MB header
  is refused after about the limit, not read whole.

A missed deadline answers 408 and an oversized head 431 (when no response is under way
on the connection), then the connection closes. Idle keep-alive connections are
uvicorn's `timeout_keep_alive`; `limit_concurrency` answers 503 past `max_connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sluice.settings import GatewaySettings


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> HttpLimits:
        return cls(settings.header_timeout_s, settings.body_timeout_s, settings.max_header_bytes)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines and a head size limit.

    One deadline at a time: the head's, then the body's. The hooks are httptools' parser
    callbacks, which run inside `data_received` (so `_in_head` is exact after each feed).
    """

    limits: ClassVar[HttpLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = True
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self._deadline is None and idle:
            # bytes on an idle kept-alive connection start a head (even bare CRLFs)
            self._arm(self.limits.header_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)
        was_in_head = self._in_head
        super().data_received(data)
        # A chunk that ended a message and began a head is not counted: at most one
        # read (256 KiB) of slack, and a large body's last chunk is never taken for a head.
        if was_in_head and self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        if self._deadline is None:  # a pipelined request's head
            self._arm(self.limits.header_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # done already when llhttp ended the upgrade request; a guard
        super().handle_websocket_upgrade()

    def _arm(self, timeout_s: float, status: http.HTTPStatus) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, self._refuse, status)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _refuse(self, status: http.HTTPStatus) -> None:
        """Answer `status` if nothing else is being answered on this connection; close."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            body = f"{status.phrase}\n".encode()
            head = (
                f"HTTP/1.1 {status.value} {status.phrase}\r\n"
                "content-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\n"
                "connection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, with `limits` bound."""
    return type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


class GatewayServer(uvicorn.Server):
    """uvicorn without its signal handlers: the CLI installs its own (see `_uvicorn`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_server(app: Any, settings: GatewaySettings) -> GatewayServer:
    """The server `sluice serve` and `sluice gateway` run, limits from `settings`."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        http=guarded_protocol(HttpLimits.from_settings(settings)),
        timeout_keep_alive=settings.keepalive_timeout_s,
        limit_concurrency=settings.max_connections,
    )
    return GatewayServer(config)
