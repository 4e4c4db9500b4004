"""Streams every client can parse: text holding Unicode line separators survives them.

httpx's `iter_lines` (under guidellm and other load testers) splits lines where
`str.splitlines` does, so a raw U+0085, U+2028 or U+2029 inside an SSE data line cut it
in two and the client failed with a JSONDecodeError. The gateway escapes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sluice.bus.memory import MemoryEventBus
from tests.unit.api.fakes import FakeEngineWorker

# the three separators that JSON leaves raw, between other non-ASCII text
REPLY = "a\u0085b\u2028c\u2029d é你😀"
SEPARATORS = ("\x85", "\u2028", "\u2029")


@pytest.fixture
def engine(memory_bus: MemoryEventBus) -> Iterator[FakeEngineWorker]:
    worker = FakeEngineWorker(memory_bus, reply=REPLY).start()
    yield worker
    worker.stop()


def _data_lines(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    """The stream's `data:` payloads as httpx's own line reader yields them."""
    payloads: list[Any] = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                payloads.append(data if data == "[DONE]" else json.loads(data))
            else:  # a cut line would show up here as a fragment of JSON
                assert line == "" or line.startswith(("event: ", "id: ", ":")), line
    return payloads


def test_chat_stream_reads_with_httpx_line_reader(client: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    payloads = _data_lines(client, "/v1/chat/completions", body)
    assert payloads[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in payloads[:-1])
    assert text == REPLY


def test_completions_stream_reads_with_httpx_line_reader(client: TestClient) -> None:
    payloads = _data_lines(
        client, "/v1/completions", {"model": "tiny", "prompt": "Hi", "stream": True}
    )
    assert payloads[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in payloads[:-1]) == REPLY


def test_responses_stream_reads_with_httpx_line_reader(client: TestClient) -> None:
    payloads = _data_lines(
        client, "/v1/responses", {"model": "tiny", "input": "Hi", "stream": True}
    )
    deltas = [e["delta"] for e in payloads if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == REPLY
    [completed] = [e for e in payloads if e["type"] == "response.completed"]
    assert completed["response"]["output"][0]["content"][0]["text"] == REPLY


def test_websocket_frames_carry_no_raw_separators(client: TestClient) -> None:
    with client.websocket_connect("/v1/responses") as ws:
        ws.send_json({"type": "response.create", "model": "tiny", "input": "Hi"})
        frames: list[str] = []
        while not frames or json.loads(frames[-1])["type"] != "response.completed":
            frames.append(ws.receive_text())
    assert not any(sep in frame for frame in frames for sep in SEPARATORS)
    events = [json.loads(frame) for frame in frames]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == REPLY
