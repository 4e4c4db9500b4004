"""Small bodies are built on the loop; large or unsized ones on a worker thread."""

from __future__ import annotations

import asyncio
import threading

from starlette.requests import HTTPConnection

from sluice.api.deps import INLINE_BUILD_MAX_BYTES, build_off_loop_if_large


def _conn(headers: dict[str, str]) -> HTTPConnection:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return HTTPConnection({"type": "http", "headers": raw})


def _thread_of(headers: dict[str, str]) -> int:
    async def run() -> int:
        return await build_off_loop_if_large(_conn(headers), threading.get_ident)

    return asyncio.run(run())


def test_where_a_request_is_built() -> None:
    here = threading.get_ident()  # asyncio.run's loop runs on this thread
    assert _thread_of({"content-length": "512"}) == here
    assert _thread_of({"content-length": str(INLINE_BUILD_MAX_BYTES + 1)}) != here
    assert _thread_of({"transfer-encoding": "chunked"}) != here
