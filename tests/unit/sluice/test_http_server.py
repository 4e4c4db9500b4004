"""The gateway's HTTP server (`sluice.http_server.build_server`) on a loopback port:
slow or oversized request heads and trickled bodies are cut off; normal requests pass.

Raw sockets, because an HTTP client would not send a half head. Each wait for the
server to answer or close is a recv bounded by a generous timeout, never a sleep.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from sluice.http_server import GatewayServer
from tests.unit.api.conftest import API_KEY
from tests.unit.sluice.gateway_server import served_gateway

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
MAX_HEADER_BYTES = 16 * 1024
# far above the deadlines: reaching it means the server never closed the connection
WAIT_S = 10.0


@pytest.fixture
def server() -> Iterator[GatewayServer]:
    with served_gateway(
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        max_header_bytes=MAX_HEADER_BYTES,
    ) as (server, _):
        yield server


def _connect(server: GatewayServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.config.port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; raises TimeoutError if it never does."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def test_a_request_head_that_never_completes_is_answered_408_and_closed(
    server: GatewayServer,
) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthori")
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_a_connection_that_sends_nothing_is_closed(server: GatewayServer) -> None:
    with _connect(server) as sock:
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 408 ")


def test_a_trickled_body_is_cut_off_after_the_body_timeout(server: GatewayServer) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
        "content-length: 1000\r\n\r\n"
    )
    with _connect(server) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", ')
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_an_oversized_header_is_refused_before_it_is_read_whole(server: GatewayServer) -> None:
    # The head is never finished: an answer can only come from the size limit, after the
    # server read about MAX_HEADER_BYTES of the 8 MB (it stops reading, so sendall fails
    # or stalls once the socket buffers are full).
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ")
        sock.settimeout(2.0)
        sent = 0
        try:
            while sent < 8 * 1024 * 1024:
                sent += sock.send(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        sock.settimeout(WAIT_S)
        answer = _read_until_closed(sock)
    # the answer may be lost to the reset that closing with unread bytes sends
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
    assert sent < 8 * 1024 * 1024 or answer.startswith(b"HTTP/1.1 431 ")


def test_normal_requests_still_work_and_keep_alive(server: GatewayServer) -> None:
    base = f"http://127.0.0.1:{server.config.port}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=WAIT_S) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        reply = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        # a request head just under the limit is still accepted
        padded = {**headers, "x-pad": "p" * (MAX_HEADER_BYTES - 1024)}
        assert client.get("/v1/models", headers=padded).status_code == 200


def test_a_websocket_outlives_the_head_and_body_deadlines(server: GatewayServer) -> None:
    from websockets.sync.client import connect

    uri = f"ws://127.0.0.1:{server.config.port}/v1/responses"
    create = {"type": "response.create", "model": "tiny", "input": "hi", "max_output_tokens": 2}
    with connect(uri, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        for _ in range(2):
            ws.send(json.dumps(create))
            kinds = [json.loads(ws.recv(timeout=WAIT_S))["type"]]
            while kinds[-1] not in ("response.completed", "response.incomplete", "error"):
                kinds.append(json.loads(ws.recv(timeout=WAIT_S))["type"])
            assert kinds[0] == "response.created" and kinds[-1] != "error", kinds
            # idle past both deadlines: a timer left from the upgrade would close it now
            with pytest.raises(TimeoutError):
                ws.recv(timeout=3 * max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S))
