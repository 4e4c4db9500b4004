"""Embedded mode before its engine is ready: probes say so, generation is refused at once.

`sluice serve` puts its engine worker's probe on `app.state.worker_probe`; until it says
ready, `/readyz` is 503 and chat, completions and responses answer 503 with `retry-after`
instead of waiting out the model's load. `/health` answers as `/healthz`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.unit.api.fakes import FakeEngineWorker

GENERATION = [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2}),
]


@dataclass
class Probe:
    """A `WorkerProbe` (api.routes.health) whose answers the test sets."""

    is_ready: bool = False
    is_healthy: bool = True
    cause: str | None = None

    def ready(self) -> bool:
        return self.is_ready

    def healthy(self) -> bool:
        return self.is_healthy

    def unavailable(self) -> str | None:
        return self.cause


@pytest.fixture
def probe(app: FastAPI) -> Probe:
    app.state.worker_probe = probe = Probe()
    return probe


@pytest.fixture
def loading(client: TestClient, probe: Probe) -> TestClient:
    """A client of the app while its engine worker is loading."""
    return client


@pytest.mark.parametrize(("path", "body"), GENERATION, ids=[p for p, _ in GENERATION])
def test_generation_before_the_engine_is_ready_is_503_with_retry_after(
    loading: TestClient, path: str, body: dict[str, object]
) -> None:
    r = loading.post(path, json={**body, "stream": False})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "5"
    assert r.headers["x-should-retry"] == "true"
    assert r.headers["x-request-id"]
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_not_ready")
    assert "not ready" in error["message"]


@pytest.mark.parametrize(("path", "body"), GENERATION, ids=[p for p, _ in GENERATION])
def test_generation_while_no_engine_comes_up_is_503_naming_the_cause(
    loading: TestClient, probe: Probe, path: str, body: dict[str, object]
) -> None:
    probe.cause = "no engine is up: the upstream server at http://h:8000 does not answer"
    r = loading.post(path, json={**body, "stream": False})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "10" and r.headers["x-should-retry"] == "true"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "engine_unavailable")
    assert error["message"] == probe.cause


def test_streamed_generation_is_refused_before_the_stream_starts(loading: TestClient) -> None:
    path, body = GENERATION[0]
    r = loading.post(path, json={**body, "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.headers["content-type"].startswith("application/json")


def test_once_ready_requests_go_through_and_refused_ones_never_reached_the_engine(
    loading: TestClient, probe: Probe, engine: FakeEngineWorker
) -> None:
    for path, body in GENERATION:
        assert loading.post(path, json=body).status_code == 503
    assert loading.get("/readyz").status_code == 503
    assert loading.get("/readyz").json()["engine_worker"] == "not ready"

    probe.is_ready = True
    path, body = GENERATION[0]
    r = loading.post(path, json={**body, "max_tokens": 5})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Hello"
    assert len(engine.wait_for_requests(1)) == 1  # only the request made after ready
    assert loading.get("/readyz").status_code == 200


def test_health_answers_as_healthz(loading: TestClient, probe: Probe) -> None:
    # loading is healthy: a supervisor must not restart a process that is loading
    assert loading.get("/health").status_code == 200
    assert loading.get("/health").json() == loading.get("/healthz").json() == {"status": "ok"}
    probe.is_healthy = False  # the engine worker stopped for good
    assert loading.get("/health").status_code == 503
    assert loading.get("/health").json() == loading.get("/healthz").json()


def test_health_is_in_the_openapi_document_without_auth(client: TestClient) -> None:
    health = client.get("/openapi.json").json()["paths"]["/health"]
    assert health["get"]["tags"] == ["health"]
    assert "security" not in health["get"]  # probes carry no key
