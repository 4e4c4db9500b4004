"""Schemathesis fuzzes a real `sluice serve` from its own /openapi.json: no request is a 5xx.

Every operation the document lists gets examples, coverage (boundary values, missing
and wrong-typed fields) and a bounded, seeded number of generated requests, positive
and negative, each with the key its route takes. A 4xx must still be an OpenAI error
object, which is what the SDKs parse.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import Case, CheckContext, Response
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.schemas import BaseSchema

from tests.e2e.procs import API_KEY, serving

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-e2e-admin-key"
SEED = 1
MAX_EXAMPLES = 50  # generated requests per operation, on top of examples and coverage

# Generation is the expensive part of a request, and how long it runs is not what is under
# test: a count the server would serve is capped (one above the context length is kept,
# its 400 comes before any generation) and a missing length is set, so the default "rest
# of the context" is never generated.
CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "max_output_tokens": 3,
        "n": 2, "best_of": 2}  # fmt: skip
LENGTH_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}
MAX_PROMPTS = 3  # a batch of prompts in /v1/completions: one generation each


@pytest.fixture(scope="module")
def served(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # a data dir of its own: the fuzzer creates tenants through the admin API, and once a
    # tenant exists the other e2e servers' static key would stop working; the model
    # files are shared (made once)
    own = tmp_path_factory.mktemp("fuzz")
    (data_dir / "models").mkdir(exist_ok=True)
    (own / "models").symlink_to(data_dir / "models")
    with serving(own, own / "serve.log", {"SLUICE_ADMIN_KEY": ADMIN_KEY}) as (base, proc):
        yield base
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


@pytest.fixture(scope="module")
def served_model(served: str) -> dict[str, Any]:
    """The served model's card (`id`, `max_model_len`)."""
    models = httpx.get(f"{served}/v1/models", headers=_auth("/v1/models")).json()["data"]
    return dict(models[0])


@pytest.fixture(scope="module")
def api_schema(served: str) -> BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "base-url": served,
            "request-timeout": 60,
            # the default list also hides every field whose name holds "token"
            # (max_tokens, stop_token_ids), which a reproduction needs
            "output": {"sanitization": {"keys-to-sanitize": ["authorization"]}},
            "generation": {
                "max-examples": MAX_EXAMPLES,
                "deterministic": True,
                "database": "none",  # no examples replayed from an earlier run
            },
        }
    )
    return schemathesis.openapi.from_url(f"{served}/openapi.json", config=config)


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32 names each operation's subtest through `Node._nodeid`, which
    pytest 9.2 no longer has (its id is the read-only `nodeid`): give it one to rename."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_no_server_errors(case: Case, served_model: dict[str, Any]) -> None:
    _cheapen(case, served_model)
    case.call_and_validate(
        headers=_auth(case.path),
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
            errors_are_openai_objects,
            streams_end_without_errors,
        ],
    )


def errors_are_openai_objects(ctx: CheckContext, response: Response, case: Case) -> None:
    """A 4xx body is `{"error": {"message": str, "type": str, ...}}`."""
    if not 400 <= response.status_code < 500:
        return
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError) as exc:
        raise AssertionError(f"{response.status_code} is not an error object: {exc!r}") from None
    assert isinstance(error, dict), error
    assert isinstance(error.get("message"), str), error
    assert isinstance(error.get("type"), str), error


def streams_end_without_errors(ctx: CheckContext, response: Response, case: Case) -> None:
    """A streamed 200 has no error event: once the stream is open, an error is the server's
    (a chat or completions `{"error": ...}` chunk, a Responses `response.failed`)."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return
    for line in response.content.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        assert event.get("type") not in ("error", "response.failed"), event
        assert not isinstance(event.get("error"), dict), event


def _auth(path: str) -> dict[str, str]:
    key = ADMIN_KEY if path.startswith("/admin/") else API_KEY
    return {"Authorization": f"Bearer {key}"}


def _cheapen(case: Case, served_model: dict[str, Any]) -> None:
    """Cap what a generation costs; aim half the bodies at the served model."""
    body = case.body
    if not isinstance(body, dict) or case.path not in LENGTH_FIELDS:
        return
    # An unknown model is a 404 before anything else is looked at; names of even length
    # become the served one so the rest of the body is checked and generated from
    model = body.get("model")
    if isinstance(model, str) and len(model) % 2 == 0:
        body["model"] = served_model["id"]
        # and those with an even number of fields stream: bodies valid enough to be
        # served seldom say so themselves
        if isinstance(body.get("stream", False), bool) and len(body) % 2 == 0:
            body["stream"] = True
    for name, cap in CAPS.items():
        value = body.get(name)
        if type(value) is int and cap < value <= served_model["max_model_len"]:
            body[name] = cap
    fields = LENGTH_FIELDS[case.path]
    if all(body.get(name) is None for name in fields):
        body[fields[0]] = CAPS[fields[0]]
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
