"""Chat and completions over the in-process app: answers, streams, lanes, request ids."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from sluice.bus.topics import Lane, request_topic
from tests.unit.api.fakes import ByteTokenizer, FakeEngineWorker

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
PROMPT_IDS = ByteTokenizer().encode("<user>Hi\n<assistant>")


def sse_payloads(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, `[DONE]` kept as the string."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_list(client: TestClient) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert r.headers["x-request-id"].startswith("req_")
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [
        ("tiny", "model", "sluice")
    ]


def test_chat_non_stream(client: TestClient, engine: FakeEngineWorker) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "metadata": {"a": "b"}, "user": "u"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-" + r.headers["x-request-id"].removeprefix("req_")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert body["usage"]["completion_tokens"] == 11
    assert body["usage"]["total_tokens"] == len(PROMPT_IDS) + 11
    assert body["service_tier"] == "default"
    [(topic, req)] = engine.requests
    assert topic == request_topic(Lane.STANDARD, "tiny")
    assert req.prompt_token_ids == PROMPT_IDS
    assert req.request_id == r.headers["x-request-id"]
    assert (req.tenant_id, req.cache_salt) == ("default", "default")
    assert req.key_id is not None and req.key_id.startswith("key_")
    assert req.sampling.max_tokens == 256 - len(PROMPT_IDS)  # default: the rest of the context
    assert req.deadline_ms is not None and req.deadline_ms > req.created_ms


def test_chat_stream_with_usage(client: TestClient) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("req_")
        assert r.headers["x-accel-buffering"] == "no"
        payloads = sse_payloads(r.read().decode())
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 11
    assert usage_chunk["usage"]["prompt_tokens"] == len(PROMPT_IDS)


def test_chat_stream_without_usage_has_no_usage_chunk(client: TestClient) -> None:
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        payloads = sse_payloads(r.read().decode())
    assert all(p["choices"] for p in payloads[:-1])
    assert payloads[-1] == "[DONE]"


def test_chat_n2_and_logprobs(client: TestClient, engine: FakeEngineWorker) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={**CHAT, "n": 2, "seed": 7, "logprobs": True, "top_logprobs": 1, "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["message"]["content"] for c in choices] == ["Hel", "Hel"]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    content = choices[0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["H", "e", "l"]
    assert content[0]["top_logprobs"] == [{"token": "H", "logprob": -0.5, "bytes": [72]}]
    seeds = sorted(req.sampling.seed or 0 for req in engine.wait_for_requests(2))
    assert seeds == [7, 8]
    assert r.json()["usage"]["completion_tokens"] == 6


def test_service_tier_selects_lane(client: TestClient, engine: FakeEngineWorker) -> None:
    for tier, lane, echoed in [
        ("priority", Lane.INTERACTIVE, "priority"),
        ("flex", Lane.BATCH, "flex"),
        ("auto", Lane.STANDARD, "default"),
    ]:
        r = client.post("/v1/chat/completions", json={**CHAT, "service_tier": tier})
        assert r.status_code == 200
        assert r.json()["service_tier"] == echoed
        assert engine.requests[-1][0] == request_topic(lane, "tiny")


def test_completions_token_ids(client: TestClient, engine: FakeEngineWorker) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert engine.requests[0][1].prompt_token_ids == [5, 6, 7]
    assert engine.requests[0][1].sampling.max_tokens == 5


def test_completions_list_of_prompts_streamed(client: TestClient) -> None:
    body = {
        "model": "tiny",
        "prompt": ["a", "bc"],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        payloads = sse_payloads(r.read().decode())
    texts = {0: "", 1: ""}
    for p in payloads[:-2]:
        for c in p["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: "Hell", 1: "Hell"}
    assert payloads[-2]["choices"] == []
    assert payloads[-2]["usage"]["prompt_tokens"] == 3
    assert payloads[-2]["usage"]["completion_tokens"] == 8


def test_completions_text_prompt_logprobs(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "logprobs": 1}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e"]
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, 1]


def test_health_ready_docs(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["reply_consumer"] is True
    assert client.get("/openapi.json").json()["paths"]["/v1/chat/completions"]
    assert client.get("/docs").status_code == 200
