"""Parameters once accepted silently, each now a 400 naming it, before anything is published.

`min_p` outside [0, 1], `prompt_logprobs` above the logprobs limit or with `stream`,
booleans as token ids, a string as `stream_options.include_usage`, and an empty Responses
`input`.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.unit.api.fakes import FakeEngineWorker
from tests.unit.api.test_chat_completions import CHAT
from tests.unit.api.test_errors import assert_error
from tests.unit.api.test_hostile_inputs import COMPLETION, RESPONSE

BODIES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


@pytest.mark.parametrize("min_p", [2, 1e308, -1])
@pytest.mark.parametrize("path,body", BODIES)
def test_min_p_outside_zero_to_one_is_400(
    client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any], min_p: float
) -> None:
    r = client.post(path, json={**body, "min_p": min_p})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "min_p")
    assert engine.requests == []


def test_min_p_is_served_only_as_zero(client: TestClient, engine: FakeEngineWorker) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "min_p": 0.1})
    assert_error(r, 400, "invalid_request_error", "unsupported_parameter", "min_p")
    assert client.post("/v1/completions", json={**COMPLETION, "min_p": 0}).status_code == 200


@pytest.mark.parametrize("path,body", BODIES)
def test_prompt_logprobs_are_bounded_and_not_streamed(
    client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any]
) -> None:
    r = client.post(path, json={**body, "prompt_logprobs": 1e9})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "prompt_logprobs")
    assert "at most 20" in r.json()["error"]["message"]
    r = client.post(path, json={**body, "prompt_logprobs": -1})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "prompt_logprobs")
    r = client.post(path, json={**body, "prompt_logprobs": 1, "stream": True})
    assert_error(r, 400, "invalid_request_error", "unsupported_parameter", "prompt_logprobs")
    assert engine.requests == []
    assert client.post(path, json={**body, "prompt_logprobs": 1}).status_code == 200
    assert [r.sampling.prompt_logprobs for r in engine.wait_for_requests(1)] == [1]


@pytest.mark.parametrize("prompt", [[True, False], [[1, True]], [1, 2.0], 5])
def test_token_ids_must_be_json_integers(
    client: TestClient, engine: FakeEngineWorker, prompt: Any
) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "prompt")
    r = client.post("/v1/completions", json={**COMPLETION, "stop_token_ids": [True]})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "stop_token_ids.0")
    assert engine.requests == []


@pytest.mark.parametrize("prompt", ["hi", ["hi", "yo"], [104, 105], [[104], [105, 105]]])
def test_every_prompt_shape_still_passes(
    client: TestClient, engine: FakeEngineWorker, prompt: Any
) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["yes", 1, "true"])
@pytest.mark.parametrize("path,body", BODIES)
def test_include_usage_must_be_a_boolean(
    client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any], value: Any
) -> None:
    options = {"stream": True, "stream_options": {"include_usage": value}}
    r = client.post(path, json={**body, **options})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "stream_options.include_usage")
    assert engine.requests == []


def test_responses_input_must_not_be_an_empty_list(
    client: TestClient, engine: FakeEngineWorker
) -> None:
    r = client.post("/v1/responses", json={**RESPONSE, "input": []})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "input")
    assert engine.requests == []
