"""The OpenAPI document says what the gateway does, and /docs needs no CDN.

Validation errors are 400 (the app reshapes FastAPI's 422), so no operation may list
422; the generation routes list 400 with the OpenAI error object and offer SSE; and the
documented schemas accept what the routes really answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.testclient import TestClient

from sluice.api.openapi import (
    OPERATIONS,
    ChatCompletion,
    Completion,
    ErrorResponse,
    Model,
    ModelList,
    ResponseObject,
)

GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _document(client: TestClient) -> dict[str, Any]:
    reply = client.get("/openapi.json")
    assert reply.status_code == 200
    doc: dict[str, Any] = reply.json()
    return doc


def test_no_operation_documents_422(client: TestClient) -> None:
    doc = _document(client)
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert "422" not in op["responses"], (method, path)
    assert "HTTPValidationError" not in json.dumps(doc)


def test_generation_routes_document_400_with_the_error_object_and_sse(client: TestClient) -> None:
    doc = _document(client)
    for path in GENERATION:
        responses = doc["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "429"):
            assert responses[status]["content"]["application/json"]["schema"] == ERROR_REF, (
                path,
                status,
            )
        content = responses["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path
        assert content["application/json"]["schema"]["$ref"].startswith("#/components/schemas/")
    error = doc["components"]["schemas"]["ErrorObject"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}


def test_admin_routes_document_their_auth_and_conflict_statuses(client: TestClient) -> None:
    doc = _document(client)
    create = doc["paths"]["/admin/v1/tenants"]["post"]["responses"]
    assert {"201", "400", "401", "403", "404", "409"} <= set(create)
    assert doc["paths"]["/admin/v1/tenants"]["post"]["security"] == [{"adminKey": []}]
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]


def test_every_operation_is_described(client: TestClient) -> None:
    doc = _document(client)
    operations = {(m.upper(), path) for path, methods in doc["paths"].items() for m in methods}
    assert operations == set(OPERATIONS)


def test_the_documented_schemas_accept_what_the_routes_answer(client: TestClient) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ChatCompletion.model_validate(client.post("/v1/chat/completions", json=chat).json())
    prompt = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
    Completion.model_validate(client.post("/v1/completions", json=prompt).json())
    response = {"model": "tiny", "input": "hi", "max_output_tokens": 3}
    ResponseObject.model_validate(client.post("/v1/responses", json=response).json())
    ModelList.model_validate(client.get("/v1/models").json())
    Model.model_validate(client.get("/v1/models/tiny").json())
    bad = client.post("/v1/chat/completions", json={"model": "tiny"})
    assert bad.status_code == 400
    ErrorResponse.model_validate(bad.json())
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_docs_load_every_asset_from_this_server(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "http://" not in html and "https://" not in html
    urls = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
    assert len(urls) >= 4  # stylesheet, icon, script, the document
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        assert client.get(url).status_code == 200, url
