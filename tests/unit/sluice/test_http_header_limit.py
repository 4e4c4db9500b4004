"""The request head limit (`SLUICE_MAX_HEADER_BYTES`, 64 KiB) holds to the byte.

A head of exactly the limit is served; one byte more is 431, whether the head arrives in
one read with its whole request (once served up to about twice the limit), in pieces, or
as the second request of a kept-alive connection.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from sluice.http_server import GatewayServer
from sluice.settings import GatewaySettings
from tests.unit.api.conftest import API_KEY
from tests.unit.sluice.gateway_server import served_gateway

LIMIT = 64 * 1024
WAIT_S = 10.0


@pytest.fixture
def server() -> Iterator[GatewayServer]:
    assert GatewaySettings.model_fields["max_header_bytes"].default == LIMIT
    with served_gateway(max_header_bytes=LIMIT) as (server, _):
        yield server


def head(size: int, *, close: bool = True) -> bytes:
    """A GET /v1/models head of exactly `size` bytes (request line to the blank line)."""
    start = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
    if close:
        start += "Connection: close\r\n"
    start += "x-pad: "
    out = start.encode() + b"p" * (size - len(start) - 4) + b"\r\n\r\n"
    assert len(out) == size
    return out


def status_of(sock: socket.socket) -> int:
    """The status of the answer, read until the server closes the connection."""
    out = b""
    while chunk := _recv(sock):
        out += chunk
    assert out.startswith(b"HTTP/1.1 "), out[:200]
    return int(out[9:12])


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def read_response(sock: socket.socket) -> bytes:
    """One whole response on a kept-alive connection (its body by content-length)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536)
    top, _, body = out.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in top.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return top


def connect(server: GatewayServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.config.port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


@pytest.mark.parametrize("size,status", [(LIMIT, 200), (LIMIT + 1, 431)])
def test_a_head_sent_whole_is_held_to_the_byte(
    server: GatewayServer, size: int, status: int
) -> None:
    with connect(server) as sock:
        sock.sendall(head(size))
        assert status_of(sock) == status


@pytest.mark.parametrize("size,status", [(LIMIT, 200), (LIMIT + 1, 431)])
def test_a_head_sent_in_pieces_is_held_to_the_byte(
    server: GatewayServer, size: int, status: int
) -> None:
    whole = head(size)
    with connect(server) as sock:
        for i in range(0, size, 10_000):
            sock.sendall(whole[i : i + 10_000])
        assert status_of(sock) == status


@pytest.mark.parametrize("size,status", [(LIMIT, 200), (LIMIT + 1, 431)])
def test_the_second_head_of_a_kept_alive_connection_is_held_to_the_byte(
    server: GatewayServer, size: int, status: int
) -> None:
    with connect(server) as sock:
        sock.sendall(head(1000, close=False))
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(head(size))
        assert status_of(sock) == status
