"""Requests schemathesis found answered 5xx by `sluice serve`, now 4xx at the gateway.

Each test is the smallest request of a failure `tests/e2e/test_schemathesis.py` found.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.unit.api.fakes import FakeEngineWorker
from tests.unit.api.test_chat_completions import CHAT
from tests.unit.api.test_errors import assert_error
from tests.unit.api.test_hostile_inputs import COMPLETION, RESPONSE

ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
          ("/v1/responses", RESPONSE)]  # fmt: skip


@pytest.mark.parametrize("top_p", [5e-324, 2.2250738585072009e-308])
@pytest.mark.parametrize("path,body", ROUTES)
def test_subnormal_top_p_is_400(
    client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any], top_p: float
) -> None:
    """The engine flushes subnormal floats to zero: top_p 5e-324 reached it as 0 (500)."""
    r = client.post(path, json={**body, "top_p": top_p})
    assert_error(r, 400, "invalid_request_error", "invalid_value", "top_p")
    assert engine.requests == []


@pytest.mark.parametrize("path,body", ROUTES)
def test_smallest_normal_top_p_is_served(
    client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any]
) -> None:
    r = client.post(path, json={**body, "top_p": 2.2250738585072014e-308})
    assert r.status_code == 200, r.text
    assert engine.wait_for_requests(1)[0].sampling.top_p == 2.2250738585072014e-308
