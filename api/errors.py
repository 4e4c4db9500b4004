"""The one place that maps errors to HTTP: OpenAI error objects for every failure.

Every error the gateway answers is `{"error": {"message", "type", "param", "code"}}`
(the OpenAI API reference's error object) with the status the OpenAI SDK expects (openai-python
`_exceptions.py`, `_base_client.py` for its retries), and `x-request-id`.

APIError                         root; carries status, type, code, param, headers
├── InvalidRequest               400 invalid_request_error (FastAPI's 422s are reshaped here)
│   └── ContextLengthExceeded    400 invalid_request_error / context_length_exceeded
├── AuthenticationFailed         401 authentication_error / invalid_api_key
├── PermissionDenied             403 permission_error (admin routes without the admin key)
├── NotFound                     404 invalid_request_error / not_found (unknown route)
│   └── ModelNotFound            404 invalid_request_error / model_not_found
├── Conflict                     409 invalid_request_error / conflict (x-should-retry: false)
├── RequestTooLarge              413 invalid_request_error / request_too_large
├── RateLimited                  429 rate_limit_error / rate_limit_exceeded (x-should-retry: true)
├── QuotaExceeded                429 insufficient_quota / insufficient_quota (x-should-retry: false)
├── ServerOverloaded             429 rate_limit_error / server_overloaded (retry-after: when the
│                                lane's backlog meets its TTFT target again; `api.slo`)
├── EngineFailed                 500 server_error (finish_reason "error")
├── ServiceUnavailable           503 server_error / bus_unavailable (retryable)
│   ├── QuotaUnavailable         503 server_error / quota_store_unavailable (budgeted tenant,
│   │                            Redis down: budgets fail closed)
│   ├── EngineNotReady           503 server_error / engine_not_ready (retry-after: the
│   │                            engine of this process is loading)
│   └── EngineUnavailable        503 service_unavailable / engine_unavailable (retry-after:
│                                no engine came up within the worker's `engine_wait_s`, or
│                                this process's engine is down; the message names the cause)
├── RequestCancelled             503 server_error / request_cancelled (x-should-retry: false)
└── DeadlineExceeded             504 timeout_error / deadline_exceeded (x-should-retry: false)

429s carry the `x-ratelimit-*` headers of the admission decision. A rate limit
(requests, tokens, concurrency) resets soon, so the SDK may retry it after `retry-after`;
an exhausted monthly budget does not, so it has no `retry-after` and
`x-should-retry: false` stops the SDK's retries. A call larger than a limit allows at all
is a 400: no wait would let it in.
`storage.errors` map here too: InvalidInput 400, NotFound 404, Conflict 409,
AuthenticationFailed 401, StoreUnavailable 503.

A deadline is the caller's own budget (`x-sluice-timeout-ms` or the gateway default), so
retrying it blindly would only spend it again: 504 says "the upstream ran out of time"
and `x-should-retry: false` keeps the SDK from its automatic retries.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.bus.messages import ENGINE_UNAVAILABLE
from sluice.storage import errors as store_errors

logger = logging.getLogger(__name__)


class APIError(Exception):
    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(APIError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status_code = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(APIError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class RequestTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(APIError):
    """A rate limit that resets soon: requests or tokens per minute, or concurrency."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers={**headers, "x-should-retry": "true"})


class QuotaExceeded(APIError):
    """The monthly budget is spent: retrying before the next period cannot help."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers={**headers, "x-should-retry": "false"})


class ServerOverloaded(APIError):
    """The lane's backlog would push this request's first token past the lane's target
    (`api.slo`); refused before anything was published or billed."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "server_overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        headers = {"retry-after": str(retry_after_s), "x-should-retry": "true"}
        super().__init__(message, headers=headers)


class EngineFailed(APIError):
    status_code = 500
    error_type = "server_error"
    code = "engine_error"


class ServiceUnavailable(APIError):
    status_code = 503
    error_type = "server_error"
    code = "bus_unavailable"


class QuotaUnavailable(ServiceUnavailable):
    code = "quota_store_unavailable"

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers={**headers, "x-should-retry": "true"})


class EngineNotReady(ServiceUnavailable):
    """Embedded mode: this process's engine is still loading (or restarting). Answered at
    once, so a client retries after `retry-after` instead of holding a request open."""

    code = "engine_not_ready"
    retry_after_s = 5

    def __init__(self) -> None:
        super().__init__(
            "the engine is not ready (loading the model, or restarting); retry shortly",
            headers={"retry-after": str(self.retry_after_s), "x-should-retry": "true"},
        )


class EngineUnavailable(ServiceUnavailable):
    """No engine is up to serve the request: it died or never started (an upstream server
    that does not answer, an engine process that fails at load). The message is the
    worker's: the cause and its fix."""

    error_type = "service_unavailable"
    code = "engine_unavailable"
    retry_after_s = 10

    def __init__(self, message: str) -> None:
        super().__init__(
            message,
            headers={"retry-after": str(self.retry_after_s), "x-should-retry": "true"},
        )


class RequestCancelled(APIError):
    status_code = 503
    error_type = "server_error"
    code = "request_cancelled"

    def __init__(self, message: str = "the request was cancelled before it finished") -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class DeadlineExceeded(APIError):
    status_code = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"

    def __init__(self, message: str = "the request's deadline passed before it finished") -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_for_finish(
    finish_reason: str, detail: str | None, code: str | None = None
) -> APIError | None:
    """The error a terminal finish_reason means for the client (None: a normal finish);
    `code`: the delta's `error_code` (ENGINE_UNAVAILABLE: 503, not 500)."""
    if finish_reason == "deadline":
        return DeadlineExceeded()
    if finish_reason == "abort":
        return RequestCancelled()
    if finish_reason == "error" and code == ENGINE_UNAVAILABLE:
        return EngineUnavailable(detail or "no engine is up to serve this request")
    if finish_reason == "error":
        return EngineFailed(detail or "the engine failed while generating this request")
    return None


def error_response(exc: APIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(exc.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def _request_id(request: Request) -> str | None:
    value = getattr(request.state, "request_id", None)
    return value if isinstance(value, str) else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for the first problem, and the dotted parameter it names."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, param


def from_billing(exc: store_errors.StoreError) -> APIError:
    """A billing error as the HTTP error it means for the caller."""
    message = str(exc)
    if isinstance(exc, store_errors.NotFound):
        return NotFound(message, code="not_found")
    if isinstance(exc, store_errors.Conflict):
        return Conflict(message)
    if isinstance(exc, store_errors.InvalidInput):
        return InvalidRequest(message, code="invalid_value")
    if isinstance(exc, store_errors.AuthenticationFailed):
        return AuthenticationFailed("incorrect API key provided")
    return ServiceUnavailable(
        "the tenant store is unavailable; retry shortly", code="store_unavailable"
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc, _request_id(request))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        code = None if param is None else "invalid_value"
        return error_response(InvalidRequest(message, param=param, code=code), _request_id(request))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err: APIError
        if exc.status_code == 404:
            err = NotFound(f"no route for {request.method} {request.url.path}")
        else:
            err = APIError(str(exc.detail))
            err.status_code = exc.status_code
            err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
            err.headers = dict(exc.headers or {})
        return error_response(err, _request_id(request))

    async def on_billing(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, store_errors.StoreError)
        return error_response(from_billing(exc), _request_id(request))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error request_id=%s", _request_id(request))
        return error_response(APIError("internal server error"), _request_id(request))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(store_errors.StoreError, on_billing)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
