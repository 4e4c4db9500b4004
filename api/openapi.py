"""The gateway's OpenAPI document as the gateway behaves, and `/docs` served without a CDN.

`install_openapi` wraps FastAPI's generator: it drops the 422 FastAPI adds to every
operation (the app answers validation errors 400, see `api.errors`), documents each
operation's error statuses with the OpenAI error object, fills in the 200 response's
schema, adds `text/event-stream` where `"stream": true` answers with SSE, and names the
bearer keys. The response models below describe; nothing validates output against them.

`install_docs` serves Swagger UI from the `swagger-ui-bundle-v2` package's files.

Every HTTP route has an entry in `OPERATIONS` (a test holds each route to it), so a new
route is documented where its error statuses are decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse

REF = "#/components/schemas/{model}"
DOCS_ASSETS = "/docs/assets"


class _Described(BaseModel):
    """A response as documented: the listed fields, and others allowed."""

    model_config = ConfigDict(extra="allow")


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the gateway answers (`api.errors`)."""

    error: ErrorObject


class CompletionUsage(_Described):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ChatCompletionMessage(_Described):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None


class _Choice(_Described):
    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatChoice(_Choice):
    message: ChatCompletionMessage


class CompletionChoice(_Choice):
    text: str
    token_ids: list[int] | None = None  # with `return_token_ids` (vLLM's extension)


class _Answer(_Described):
    """What every completion object and chunk carries."""

    id: str
    created: int
    model: str
    usage: CompletionUsage | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    choices: list[ChatChoice]


class ChatCompletionChunk(_Answer):
    """One `data:` line of a chat stream; `usage` only on the last, when asked for."""

    object: Literal["chat.completion.chunk"]
    choices: list[dict[str, Any]]


class Completion(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class CompletionChunk(_Described):
    """One `data:` line of a completions stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ResponseUsage(_Described):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Described):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    usage: ResponseUsage | None = None


class ResponseStreamEvent(_Described):
    """One SSE event of a Responses stream (`event:` names its `type`)."""

    type: str
    sequence_number: int


class Model(_Described):
    """A served model, alias or LoRA adapter, as vLLM's model cards: `root` an alias's
    target or an adapter's directory, `parent` an adapter's base model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(_Described):
    object: Literal["list"]
    data: list[Model]


class UsageReport(_Described):
    """Requests, tokens and cost, in total, by model and by day."""

    object: Literal["usage"]


class ObjectList(_Described):
    object: Literal["list"]
    data: list[dict[str, Any]]


class Record(_Described):
    """An admin record (tenant, key or price)."""


class FileObject(_Described):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None


class FileList(_Described):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(_Described):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ResponseItemList(_Described):
    """A page of a stored response's input items (`after=<last_id>` while `has_more`)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(_Described):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchRequestCounts(_Described):
    total: int
    completed: int
    failed: int


class BatchUsage(_Described):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class BatchErrors(_Described):
    object: Literal["list"]
    data: list[dict[str, Any]]


class Batch(_Described):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None = None


class BatchList(_Described):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


ERROR_DESCRIPTIONS = {
    400: "Invalid request: a body field or parameter failed validation",
    401: "Missing or unknown API key",
    403: "The admin API is disabled (no SLUICE_ADMIN_KEY on the gateway)",
    404: "Unknown model, file, batch, response or record, or no tenant store behind this gateway",
    409: "The name is already taken, or the batch has finished and cannot be cancelled",
    413: "The request body is larger than SLUICE_MAX_BODY_BYTES (an upload: than a batch "
    "file may be)",
    429: "A rate limit (retry after `retry-after`) or the monthly budget (insufficient_quota)",
    500: "The engine failed while generating",
    503: "The bus or a store is unavailable, the request was cancelled, or the engine is "
    "still loading (retry; after `retry-after` when given); or files and batches are off, "
    "with no SLUICE_DATABASE_URL",
    504: "The request's deadline (x-sluice-timeout-ms) passed",
}

GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)
ADMIN_READ_ERRORS = (400, 401, 403, 404, 503)
ADMIN_WRITE_ERRORS = (400, 401, 403, 404, 409, 413, 503)
BATCH_READ_ERRORS = (401, 404, 503)


@dataclass(frozen=True, slots=True)
class Operation:
    """What one operation answers: its success body, its SSE event, its error statuses."""

    model: type[BaseModel] | None
    errors: tuple[int, ...] = ()
    stream: type[BaseModel] | None = None
    security: str | None = "apiKey"


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/healthz"): Operation(None, security=None),
    ("GET", "/health"): Operation(None, security=None),
    ("GET", "/readyz"): Operation(None, security=None),
    ("GET", "/v1/models"): Operation(ModelList, (401,)),
    ("GET", "/v1/models/{model}"): Operation(Model, (401, 404)),
    ("POST", "/v1/chat/completions"): Operation(
        ChatCompletion, GENERATION_ERRORS, ChatCompletionChunk
    ),
    ("POST", "/v1/completions"): Operation(Completion, GENERATION_ERRORS, CompletionChunk),
    ("POST", "/v1/responses"): Operation(ResponseObject, GENERATION_ERRORS, ResponseStreamEvent),
    # stored responses; the GET streams (`stream=true`) a background response's events
    ("GET", "/v1/responses/{response_id}"): Operation(
        ResponseObject, (400, 401, 404), ResponseStreamEvent
    ),
    ("POST", "/v1/responses/{response_id}/cancel"): Operation(ResponseObject, (400, 401, 404)),
    ("DELETE", "/v1/responses/{response_id}"): Operation(ResponseDeleted, (401, 404)),
    ("GET", "/v1/responses/{response_id}/input_items"): Operation(
        ResponseItemList, (400, 401, 404)
    ),
    ("GET", "/v1/usage"): Operation(UsageReport, (400, 401, 404, 503)),
    ("POST", "/v1/files"): Operation(FileObject, (400, 401, 413, 503)),
    ("GET", "/v1/files"): Operation(FileList, (400, 401, 503)),
    ("GET", "/v1/files/{file_id}"): Operation(FileObject, BATCH_READ_ERRORS),
    # the bytes: the route documents its own application/octet-stream answer
    ("GET", "/v1/files/{file_id}/content"): Operation(None, BATCH_READ_ERRORS),
    ("DELETE", "/v1/files/{file_id}"): Operation(FileDeleted, BATCH_READ_ERRORS),
    ("POST", "/v1/batches"): Operation(Batch, (400, 401, 413, 503)),
    ("GET", "/v1/batches"): Operation(BatchList, (400, 401, 503)),
    ("GET", "/v1/batches/{batch_id}"): Operation(Batch, BATCH_READ_ERRORS),
    ("POST", "/v1/batches/{batch_id}/cancel"): Operation(Batch, (*BATCH_READ_ERRORS, 409)),
    ("POST", "/admin/v1/tenants"): Operation(Record, ADMIN_WRITE_ERRORS, security="adminKey"),
    ("GET", "/admin/v1/tenants"): Operation(ObjectList, ADMIN_READ_ERRORS, security="adminKey"),
    ("POST", "/admin/v1/keys"): Operation(Record, ADMIN_WRITE_ERRORS, security="adminKey"),
    ("GET", "/admin/v1/keys"): Operation(ObjectList, ADMIN_READ_ERRORS, security="adminKey"),
    ("POST", "/admin/v1/keys/{key_id}/revoke"): Operation(
        Record, ADMIN_READ_ERRORS, security="adminKey"
    ),
    ("GET", "/admin/v1/usage"): Operation(UsageReport, ADMIN_READ_ERRORS, security="adminKey"),
    ("PUT", "/admin/v1/prices"): Operation(Record, ADMIN_WRITE_ERRORS, security="adminKey"),
    ("GET", "/admin/v1/prices"): Operation(ObjectList, ADMIN_READ_ERRORS, security="adminKey"),
    ("PUT", "/admin/v1/tenants/{tenant}/models"): Operation(
        Record, ADMIN_WRITE_ERRORS, security="adminKey"
    ),
    ("GET", "/admin/v1/adapters"): Operation(ObjectList, ADMIN_READ_ERRORS, security="adminKey"),
    # vLLM's shape: a line of plain text on success
    ("POST", "/v1/load_lora_adapter"): Operation(None, ADMIN_WRITE_ERRORS, security="adminKey"),
    ("POST", "/v1/unload_lora_adapter"): Operation(None, ADMIN_WRITE_ERRORS, security="adminKey"),
}

SECURITY_SCHEMES = {
    "apiKey": {"type": "http", "scheme": "bearer", "description": "A tenant or static key"},
    "adminKey": {"type": "http", "scheme": "bearer", "description": "SLUICE_ADMIN_KEY"},
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _models() -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = [ErrorResponse]
    for op in OPERATIONS.values():
        found += [m for m in (op.model, op.stream) if m is not None]
    return list(dict.fromkeys(found))


def _success(op: Operation) -> dict[str, Any]:
    assert op.model is not None
    content: dict[str, Any] = {"application/json": {"schema": _ref(op.model)}}
    if op.stream is not None:
        # the schema of one event, as SSE-aware clients and tools read a stream
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "description": f'With "stream": true: server-sent events, each `data:` a '
                f"JSON {op.stream.__name__} (see components), then `data: [DONE]` (chat "
                "and completions)",
                "properties": {
                    "event": {"type": "string"},
                    "data": {"type": "string"},
                },
                "required": ["data"],
            }
        }
    return content


def _describe_operation(op_doc: dict[str, Any], op: Operation) -> None:
    responses: dict[str, Any] = op_doc["responses"]
    responses.pop("422", None)
    if op.model is not None:
        status = next(code for code in responses if code.startswith("2"))
        responses[status]["content"] = _success(op)
    for code in op.errors:
        responses[str(code)] = {
            "description": ERROR_DESCRIPTIONS[code],
            "content": {"application/json": {"schema": _ref(ErrorResponse)}},
        }
    if op.security is not None:
        op_doc["security"] = [{op.security: []}]


def describe(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document made to match the gateway's behaviour (in place; returned)."""
    for path, methods in schema.get("paths", {}).items():
        for method, op_doc in methods.items():
            op = OPERATIONS.get((method.upper(), path))
            if op is None:
                op_doc.get("responses", {}).pop("422", None)
                continue
            _describe_operation(op_doc, op)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    _, defs = models_json_schema([(m, "serialization") for m in _models()], ref_template=REF)
    for name, definition in defs.get("$defs", {}).items():
        if schemas.get(name, definition) != definition:
            raise ValueError(f"two schemas named {name!r}: rename the one in api.openapi")
        schemas[name] = definition
    components.setdefault("securitySchemes", {}).update(SECURITY_SCHEMES)
    return schema


def install_openapi(app: FastAPI) -> None:
    """`app.openapi()` (and so /openapi.json) returns the described document, built once."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app.state, "openapi_described", None) is None:
            app.state.openapi_described = describe(generate())
        schema: dict[str, Any] = app.state.openapi_described
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def swagger_ui_dir() -> Path:
    from swagger_ui_bundle import swagger_ui_path

    return Path(str(swagger_ui_path))


def install_docs(app: FastAPI, docs_url: str = "/docs") -> None:
    """Swagger UI at `docs_url`, its script, style and icon from this server.

    The app must be built with `docs_url=None` (FastAPI's page loads them from a CDN).
    """
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_dir()), name="docs-assets")

    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - API docs",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon-32x32.png",
            # Swagger UI would send the document to validator.swagger.io for a badge
            swagger_ui_parameters={"validatorUrl": None},
        )

    app.add_route(docs_url, docs, include_in_schema=False)
