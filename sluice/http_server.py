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
- a head size limit (`max_header_bytes`), exact to the byte: the parser is fed a head
  at most that many bytes at a time, so a head of the limit passes, one byte more is
  refused, and an 8 MB header is refused after the limit, not read whole.

A missed deadline answers 408 and an oversized head 431 (when no response is under way
on the connection), then the connection closes. Idle keep-alive connections are
uvicorn's `timeout_keep_alive`; `limit_concurrency` answers 503 past `max_connections`.

A hostile client must not grow the gateway or take every slot:

- the send buffer: a response's `send` waits once `send_buffer_bytes` are buffered for
  the client, and a connection whose buffer then drains not at all for
  `send_stall_timeout_s` (the client stopped reading) is aborted. The app sees a
  disconnect, so a stream ends and its request is cancelled on the bus;
- per peer: a peer address with `max_connections_per_peer` open connections gets 503
  and a close for the next one;
- at `max_connections` a new connection first closes the longest-idle connections that
  have no request in flight (never sent a whole head, or kept alive between requests),
  so idle sockets cannot lock out a client that has something to ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sluice.api.streaming import SEND_STALLED
from sluice.settings import GatewaySettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    send_buffer_bytes: int = 64 * 1024
    send_stall_timeout_s: float = 15.0
    max_connections_per_peer: int = 0  # 0: no cap

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> HttpLimits:
        return cls(
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_header_bytes,
            send_buffer_bytes=settings.send_buffer_bytes,
            send_stall_timeout_s=settings.send_stall_timeout_s,
            max_connections_per_peer=settings.max_connections_per_peer,
        )


@dataclass(slots=True)
class PeerCounts:
    """Open HTTP connections per peer address, shared by one server's connections."""

    open: dict[str, int] = field(default_factory=dict)

    def add(self, peer: str) -> int:
        self.open[peer] = count = self.open.get(peer, 0) + 1
        return count

    def remove(self, peer: str) -> None:
        count = self.open.get(peer, 0) - 1
        if count > 0:
            self.open[peer] = count
        else:
            self.open.pop(peer, None)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines and a head size limit.

    One deadline at a time: the head's, then the body's. The hooks are httptools' parser
    callbacks, which run inside `data_received` (so the flags are exact after each feed).
    Between messages or in a head, a read is fed up to what the head may still hold; if
    the head is still open with bytes left over, it is too large. The one head not
    counted whole is a pipelined one that begins in the read that ended the message
    before it: it may exceed the limit by that read's share.
    """

    limits: ClassVar[HttpLimits]
    peers: ClassVar[PeerCounts]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._peer: str | None = None  # counted in `peers` while set
        self._idle_since = time.monotonic()
        self._in_head = False  # a message began and its headers have not ended
        self._in_body = False  # its headers ended and the message has not
        self._ended_message = False  # a message ended during the current feed
        self._upgraded = False
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=self.limits.send_buffer_bytes)
        peername = transport.get_extra_info("peername")
        peer = peername[0] if isinstance(peername, tuple) else None
        cap = self.limits.max_connections_per_peer
        if peer is not None:
            if cap and self.peers.open.get(peer, 0) >= cap:
                logger.warning("connection refused: %s has %s open connections", peer, cap)
                self._refuse(http.HTTPStatus.SERVICE_UNAVAILABLE)
                return
            self._peer = peer
            self.peers.add(peer)
        self._evict_idle()
        self._arm(self.limits.header_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_stall()
        self._forget_peer()
        super().connection_lost(exc)

    def _forget_peer(self) -> None:
        if self._peer is not None:
            self.peers.remove(self._peer)
            self._peer = None

    @property
    def idle(self) -> bool:
        """No request in flight: no whole head yet, or between kept-alive requests."""
        return self.cycle is None or self.cycle.response_complete

    def _evict_idle(self) -> None:
        """At the connection limit, close the longest-idle connections to make room."""
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit:
            return
        idle = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedHttpToolsProtocol) and c.idle
        ]
        idle.sort(key=lambda c: c._idle_since)
        for victim in idle[: len(self.connections) - limit + 1]:
            victim.transport.close()
            self.connections.discard(victim)  # its connection_lost comes on a later turn

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self._deadline is None and idle:
            # bytes on an idle kept-alive connection start a head (even bare CRLFs)
            self._arm(self.limits.header_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)
        while data:
            if self._in_body:
                super().data_received(data)
                return
            if not self._in_head:
                self._head_bytes = 0
            part = data[: self.limits.max_header_bytes - self._head_bytes]
            data = data[len(part) :]
            self._ended_message = False
            super().data_received(part)
            if self._upgraded or self.transport.is_closing():
                return  # the WebSocket protocol reads from here on (or a 400 went out)
            if self._in_head and not self._ended_message:
                self._head_bytes += len(part)
                if data:  # the head holds the limit and goes on
                    self._refuse(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
                    return

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        if self._deadline is None:  # a pipelined request's head
            self._arm(self.limits.header_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._arm(self.limits.body_timeout_s, http.HTTPStatus.REQUEST_TIMEOUT)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._ended_message = True
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # done already when llhttp ended the upgrade request; a guard
        self._upgraded = True
        self._forget_peer()  # the WebSocket protocol takes the transport over
        super().handle_websocket_upgrade()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_stall(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._disarm_stall()
        super().resume_writing()

    def _arm_stall(self, buffered: int) -> None:
        self._disarm_stall()
        timeout_s = self.limits.send_stall_timeout_s
        self._stall = self.loop.call_later(timeout_s, self._check_stall, buffered)

    def _disarm_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _check_stall(self, buffered_then: int) -> None:
        """The client read some of the buffer: wait on; none of it: abort the connection."""
        self._stall = None
        buffered = self.transport.get_write_buffer_size()
        if buffered < buffered_then:
            self._arm_stall(buffered)
            return
        request_id = (self.scope or {}).get("state", {}).get("request_id")
        logger.info(
            "client stopped reading request_id=%s peer=%s: %s bytes unsent for %ss; closing",
            request_id, self._peer, buffered, self.limits.send_stall_timeout_s,
        )  # fmt: skip
        if self.scope is not None:
            self.scope.setdefault("state", {})[SEND_STALLED] = True
        self.transport.abort()

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
        cycle = self.cycle  # the last request's; a finished one is nothing under way
        if cycle is None or cycle.response_complete or not cycle.response_started:
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
    """The protocol class uvicorn instantiates per connection, with `limits` bound and
    the peer counts its connections share."""
    bound = {"limits": limits, "peers": PeerCounts()}
    return type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), bound)


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
