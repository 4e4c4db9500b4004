"""Hostile inputs get a 400 at the gateway, before anything is admitted or published.

Each of these once reached the engine (and killed it: seeds outside int64, token ids
outside the vocabulary), blocked the event loop (megabyte prompts), or answered 500 with
a request left tracked (lone surrogates).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import sluice.api.deps as api_deps
from sluice.api.app import create_app
from sluice.api.served import ServedModel
from sluice.bus.memory import MemoryEventBus
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import ByteTokenizer, FakeEngineWorker, ServerThread
from tests.unit.api.test_chat_completions import CHAT
from tests.unit.api.test_errors import assert_error

COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
RESPONSE: dict[str, Any] = {"model": "tiny", "input": "hi", "max_output_tokens": 4}


def post_raw(client: TestClient, path: str, raw_json: str) -> httpx.Response:
    """A body as written (json= would re-escape a lone surrogate as invalid UTF-8)."""
    return client.post(
        path, content=raw_json.encode(), headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMPLETION)])  # fmt: skip
def test_seed_outside_int64_is_400(
    client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any], seed: int
) -> None:
    r = client.post(path, json={**body, "seed": seed})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "seed")
    assert engine.requests == []


def test_seeds_of_later_choices_wrap_within_int64(
    client: TestClient, engine: FakeEngineWorker
) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200, r.text
    seeds = sorted(req.sampling.seed for req in engine.wait_for_requests(2))
    assert seeds == [-(2**63), 2**63 - 1]


@pytest.mark.parametrize("prompt", [[256], [-1], [[1, 2], [3, 999]]])
def test_token_ids_outside_the_vocabulary_are_400(
    client: TestClient, engine: FakeEngineWorker, prompt: Any
) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "prompt")
    assert "vocabulary" in r.json()["error"]["message"]
    assert engine.requests == []


def test_stop_token_ids_outside_the_vocabulary_are_400(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [7, 4096]})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "stop_token_ids")


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMPLETION)])  # fmt: skip
def test_min_tokens_above_max_tokens_is_400(
    client: TestClient, path: str, body: dict[str, Any]
) -> None:
    r = client.post(path, json={**body, "max_tokens": 4, "min_tokens": 5})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "min_tokens")


LONE_SURROGATE = "\\ud800"  # as JSON escapes it


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":"hi"}],'
                                 '"max_tokens":4,"stop":["SUR"]}'),
        ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":"aSUR"}]}'),
        ("/v1/chat/completions", '{"model":"tiSUR","messages":[{"role":"user","content":"hi"}]}'),
        ("/v1/completions", '{"model":"tiny","prompt":"SUR","max_tokens":4}'),
        ("/v1/completions", '{"model":"tiny","prompt":"hi","max_tokens":4,"stop":"SUR"}'),
        ("/v1/responses", '{"model":"tiny","input":"SUR","max_output_tokens":4}'),
        ("/v1/responses", '{"model":"tiny","input":[{"role":"user","content":"SUR"}]}'),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400_and_nothing_is_published(
    client: TestClient, engine: FakeEngineWorker, path: str, raw: str
) -> None:
    r = post_raw(client, path, raw.replace("SUR", LONE_SURROGATE))
    assert_error(r, 400, "invalid_request_error", None)
    assert "Unicode" in r.json()["error"]["message"]
    assert engine.requests == []
    # the gateway holds nothing for it either
    assert client.get("/readyz").json()["live_requests"] == 0


def test_a_valid_surrogate_pair_is_fine(client: TestClient) -> None:
    r = post_raw(client, "/v1/completions",
                 '{"model":"tiny","prompt":"\\ud83d\\ude00","max_tokens":4}')  # fmt: skip
    assert r.status_code == 200, r.text


def test_engine_error_detail_stays_in_the_log(
    memory_bus: MemoryEventBus, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngineWorker(memory_bus, mode="error").start()
    app = create_app(gateway_settings(), memory_bus, [_model(ByteTokenizer())])
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            r = client.post("/v1/chat/completions", json=CHAT)
    finally:
        engine.stop()
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "boom" not in message
    assert r.headers["x-request-id"] in message
    assert any("boom" in rec.getMessage() for rec in caplog.records)


class BlockingTokenizer(ByteTokenizer):
    """Counts encodes; the first long one blocks until released (a slow tokenizer)."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        if len(text) > 100:
            self.entered.set()
            assert self.release.wait(30)
        return super().encode(text, add_special_tokens)


def _model(tokenizer: ByteTokenizer, max_model_len: int = 256) -> ServedModel:
    return ServedModel(name="tiny", max_model_len=max_model_len, tokenizer=tokenizer)


@pytest.fixture
def blocking() -> Iterator[tuple[BlockingTokenizer, ServerThread]]:
    bus = MemoryEventBus()
    tokenizer = BlockingTokenizer()
    engine = FakeEngineWorker(bus).start()
    app = create_app(gateway_settings(), bus, [_model(tokenizer, max_model_len=4096)])
    with ServerThread(app) as server:
        yield tokenizer, server
    tokenizer.release.set()
    engine.stop()
    bus.close()


def test_tokenizing_does_not_block_other_requests(
    blocking: tuple[BlockingTokenizer, ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large body is built on a worker thread (here every body is "large": the test's
    tokenizer blocks whatever it is given)."""
    monkeypatch.setattr(api_deps, "INLINE_BUILD_MAX_BYTES", 0)
    tokenizer, server = blocking
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**COMPLETION, "prompt": "x" * 1000}
    answers: list[httpx.Response] = []
    slow = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        )
    )
    slow.start()
    assert tokenizer.entered.wait(10)
    # the loop still answers while that prompt is being tokenized
    r = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=5)
    assert r.status_code == 200
    tokenizer.release.set()
    slow.join(30)
    assert answers[0].status_code == 200, answers[0].text


def test_prompt_too_long_in_characters_is_refused_before_tokenizing(
    blocking: tuple[BlockingTokenizer, ServerThread],
) -> None:
    tokenizer, server = blocking
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in [
        ("/v1/completions", {**COMPLETION, "prompt": "x" * 5000}),
        ("/v1/completions", {**COMPLETION, "prompt": ["hi", "x" * 5000]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}),
        ("/v1/responses", {**RESPONSE, "input": "x" * 5000}),
    ]:
        r = httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=10)
        assert_error(r, 400, "invalid_request_error", "context_length_exceeded")
    assert tokenizer.calls == 0
