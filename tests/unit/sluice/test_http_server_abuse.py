"""The gateway's HTTP server against hostile clients, on loopback ports: a client that
stops reading a stream is cut off and its request cancelled; idle sockets of one peer
cannot take the connection slots every other client needs.

Linux routes all of 127/8 to the loopback, so 127.0.0.1 and 127.0.0.2 are two peers.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack

import httpx

from sluice.http_server import GatewayServer
from tests.unit.api.conftest import API_KEY
from tests.unit.api.fakes import FakeEngineWorker
from tests.unit.sluice.gateway_server import served_gateway
from tests.waiting import wait_until

WAIT_S = 10.0  # far above every limit here: reaching it means the server never acted
ATTACKER = "127.0.0.1"
OTHER_PEER = "127.0.0.2"


def gateway(
    engine_reply: str = "Hello world", **overrides: object
) -> AbstractContextManager[tuple[GatewayServer, FakeEngineWorker]]:
    """A served gateway (the given settings) on a memory bus, a fast fake engine behind."""
    return served_gateway(
        reply=engine_reply,
        step_s=0.0005,
        max_model_len=len(engine_reply) + 256,
        **overrides,
    )


def _connect(
    server: GatewayServer, peer: str = ATTACKER, rcvbuf: int | None = None
) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((peer, 0))
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", server.config.port))
    return sock


def _get_health_from(server: GatewayServer, peer: str) -> int:
    transport = httpx.HTTPTransport(local_address=peer)
    with httpx.Client(transport=transport, timeout=WAIT_S) as client:
        return client.get(f"http://127.0.0.1:{server.config.port}/healthz").status_code


def _wait_until(check: Callable[[], bool], what: str) -> None:
    wait_until(check, WAIT_S, what)


def test_a_stream_whose_client_stops_reading_is_cut_off_and_cancelled() -> None:
    # 64 choices a token each per engine step: over a MiB a second, for minutes
    reply = "x" * 200_000
    limits = {"send_buffer_bytes": 16 * 1024, "send_stall_timeout_s": 0.3, "max_n": 64}
    with gateway(reply, **limits) as (server, engine):
        body = json.dumps(
            {
                "model": "tiny",
                "stream": True,
                "n": 64,
                "max_tokens": len(reply),
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        with _connect(server, rcvbuf=4096) as sock:
            sock.sendall(head.encode() + body)
            # never reads: the server gives up on it and cancels every choice on the bus
            cancels = engine.wait_for_cancels(64, timeout_s=WAIT_S)
            requested = {r.request_id for r in engine.wait_for_requests(64)}
            assert {c.request_id for c in cancels} == requested
            _wait_until(lambda: not server.server_state.connections, "connection kept open")


def test_one_peer_cannot_take_every_connection_slot() -> None:
    with (
        gateway(max_connections=16, max_connections_per_peer=4) as (server, _),
        ExitStack() as held,
    ):
        idle = [held.enter_context(_connect(server)) for _ in range(24)]
        # past its cap the attacker's connections are answered 503 and closed
        assert idle[-1].recv(4096).startswith(b"HTTP/1.1 503")
        assert _get_health_from(server, OTHER_PEER) == 200


def test_idle_connections_give_way_to_a_new_one_at_the_limit() -> None:
    with (
        gateway(max_connections=16, max_connections_per_peer=0) as (server, _),
        ExitStack() as held,
    ):
        idle = [held.enter_context(_connect(server)) for _ in range(24)]
        assert _get_health_from(server, OTHER_PEER) == 200
        # the oldest idle sockets were closed to make room, without an answer
        assert idle[0].recv(4096) == b""
