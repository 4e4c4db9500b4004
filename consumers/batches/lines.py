"""A batch file's lines: parsing, the requests of a line, and its output or error line.

The formats are OpenAI's Batch API's: an input line is `{"custom_id", "method": "POST",
"url", "body"}`; an output line is `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}` where `body` is the object the endpoint itself
returns; a line that could not run has `"response": null` and an `error`. A line that
ran and then failed (an engine error, or stopped part-way by the batch's cancel or
expiry) has the endpoint's error object as its response body, with the `usage` it
consumed beside it (a stopped line keeps the `error` of an unrun one too): the usage in
the output and error files adds up to the batch's.

Structural faults (bad JSON, a missing or duplicate `custom_id`, a wrong `method` or
`url`, an unknown model) fail the whole batch at validation with their line numbers, as
OpenAI's do. A body the endpoint would refuse fails that line only: its error line
carries the endpoint's own 400 (docs/architecture.md §14).

A line's requests go through the same builders as the HTTP routes (`api/routes/`), so a
line's result equals the same request sent on its own.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sluice.api.auth import Principal
from sluice.api.deps import Gateway
from sluice.api.errors import APIError, InvalidRequest, RequestCancelled, error_for_finish
from sluice.api.formatting import ChatFormat, CompletionFormat, usage
from sluice.api.generation import ChoiceResult
from sluice.api.prepare import Call, encode_prompts, lane_for
from sluice.api.responses_format import ResponsesFormat
from sluice.api.routes import chat, completions, responses
from sluice.api.schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from sluice.api.served import ServedModel
from sluice.bus.topics import Lane

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
BATCH_REPLY_TARGET = "batches"  # the engine's deltas for batch lines: sluice.tokens.batches.v1
MAX_CUSTOM_ID = 512

_SCHEMAS: dict[str, Any] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}


@dataclass(frozen=True, slots=True)
class ParsedLine:
    line: int  # 0-based
    custom_id: str
    body: dict[str, Any]


def line_error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """An entry of the Batch object's `errors.data` (lines numbered from 1, as OpenAI)."""
    return {"code": code, "message": message, "param": param, "line": line + 1}


def parse_file(
    content: bytes, endpoint: str, models: Mapping[str, ServedModel], max_lines: int
) -> tuple[list[ParsedLine], list[dict[str, Any]]]:
    """The file's lines, or the structural errors that fail the batch (at most 100 kept)."""
    parsed: list[ParsedLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [line_error(0, "invalid_file", f"the file is not UTF-8: {exc}")]
    # "\n" only: str.splitlines() also splits at U+2028 and U+0085, which JSON strings
    # may hold raw
    raw_lines = [(i, raw) for i, raw in enumerate(text.split("\n")) if raw.strip()]
    if not raw_lines:
        return [], [line_error(0, "empty_file", "the file has no requests")]
    if len(raw_lines) > max_lines:
        message = f"the file has {len(raw_lines)} requests; a batch holds at most {max_lines}"
        return [], [line_error(0, "too_many_requests", message)]
    for number, (i, raw) in enumerate(raw_lines):
        error = _check_line(i, raw, endpoint, models, seen)
        if isinstance(error, dict):
            if len(errors) < 100:
                errors.append(error)
            continue
        parsed.append(ParsedLine(number, error[0], error[1]))
    return parsed, errors


def _check_line(
    i: int, raw: str, endpoint: str, models: Mapping[str, ServedModel], seen: set[str]
) -> dict[str, Any] | tuple[str, dict[str, Any]]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return line_error(i, "invalid_json_line", f"this line is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return line_error(i, "invalid_json_line", "each line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return line_error(
            i, "missing_custom_id", "custom_id must be a non-empty string", "custom_id"
        )
    if len(custom_id) > MAX_CUSTOM_ID:
        message = f"custom_id is longer than {MAX_CUSTOM_ID} characters"
        return line_error(i, "invalid_custom_id", message, "custom_id")
    if custom_id in seen:
        message = f"custom_id {custom_id!r} is used by an earlier line"
        return line_error(i, "duplicate_custom_id", message, "custom_id")
    seen.add(custom_id)
    if obj.get("method") != "POST":
        return line_error(i, "invalid_method", "method must be 'POST'", "method")
    if obj.get("url") != endpoint:
        message = f"url must be the batch's endpoint {endpoint!r}, got {obj.get('url')!r}"
        return line_error(i, "invalid_url", message, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return line_error(i, "invalid_body", "body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or model not in models:
        served = ", ".join(sorted(models))
        message = f"model {model!r} is not served here (served: {served})"
        return line_error(i, "model_not_found", message, "body.model")
    return custom_id, body


# -- a line's requests --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PreparedLine:
    """What a line sends: its sub-requests, on the batch lane, tagged with the batch."""

    call: Call

    @property
    def tokens(self) -> int:
        """What the line can cost the engine: every prompt plus its max_tokens."""
        return sum(len(r.prompt_token_ids) + r.sampling.max_tokens for r in self.call.requests)


def line_call_id(batch_id: str, line: int) -> str:
    """The line's call id; its requests are `req_<call id>[-<i>]` (`api.prepare.build_call`)."""
    return f"{batch_id.removeprefix('batch_')}_{line}"


def line_request_id(batch_id: str, line: int, index: int = 0) -> str:
    """The request id of a line's sub-request `index`, as `build_call` names it."""
    cid = line_call_id(batch_id, line)
    return f"req_{cid}" if index == 0 else f"req_{cid}-{index}"


def parse_request_id(request_id: str) -> tuple[str, int, int] | None:
    """(batch id, line, sub-request index) of a batch line's request id; None otherwise."""
    head, _, index = request_id.removeprefix("req_").partition("-")
    batch_hex, sep, line = head.rpartition("_")
    if not sep or not line.isdigit() or (index and not index.isdigit()):
        return None
    return f"batch_{batch_hex}", int(line), int(index or 0)


def prepare_line(
    gw: Gateway,
    endpoint: str,
    body: dict[str, Any],
    principal: Principal,
    *,
    batch_id: str,
    line: int,
    custom_id: str,
    deadline_ms: int,
) -> PreparedLine:
    """The line's requests, built as its endpoint builds them; raises the endpoint's
    `APIError` for a body it would refuse."""
    parsed = validate_body(endpoint, body)
    cid = line_call_id(batch_id, line)
    if isinstance(parsed, ChatCompletionRequest):
        call, _ = chat.build(parsed, {}, principal, gw, cid)
    elif isinstance(parsed, CompletionRequest):
        call, _ = completions.build(parsed, {}, principal, gw, cid)
    else:
        call = responses.build(parsed, {}, principal, gw, cid)
    requests = [
        r.model_copy(
            update={
                "lane": Lane.BATCH,
                "batch_id": batch_id,
                "custom_id": custom_id,
                "deadline_ms": deadline_ms,
                "reply_to": BATCH_REPLY_TARGET,
            }
        )
        for r in call.requests
    ]
    return PreparedLine(dataclasses.replace(call, requests=requests, deadline_ms=deadline_ms))


def validate_body(endpoint: str, body: dict[str, Any]) -> Any:
    """The body as the endpoint's schema reads it; a stream is answered whole in a batch."""
    try:
        parsed = _SCHEMAS[endpoint].model_validate({**body, "stream": False})
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        raise InvalidRequest(message, param=param, code="invalid_value") from exc
    return parsed


# -- a line's output or error line -----------------------------------------------------------
def _line_id() -> str:
    return f"batch_req_{time.time_ns():x}"


def _jsonl(obj: dict[str, Any]) -> str:
    """One JSONL line, ASCII: a reader splitting at U+2028 or U+0085 (Python's
    str.splitlines, httpx's line reader) still sees one line per result."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


def output_line(custom_id: str, request_id: str, status_code: int, body: dict[str, Any]) -> str:
    obj = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }
    return _jsonl(obj)


def unrun_line(custom_id: str, code: str, message: str) -> str:
    """The error line of a line that did not run (batch_expired, batch_cancelled)."""
    obj = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return _jsonl(obj)


def refused_line(
    custom_id: str, request_id: str, error: APIError, usage: dict[str, Any] | None = None
) -> str:
    """A line whose body the endpoint refused, or whose run ended in an error; `usage`
    (the endpoint's usage object) what it consumed before it stopped, next to the error."""
    body = error.body()
    if usage is not None:
        body["usage"] = usage
    return output_line(custom_id, request_id, error.status_code, body)


class LineStopped(RequestCancelled):
    """A line the batch's cancel or expiry stopped part-way (code `batch_cancelled` or
    `batch_expired`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def stopped_line(custom_id: str, request_id: str, error: LineStopped, usage: dict[str, Any]) -> str:
    """The error line of a line the batch's cancel or expiry stopped after it ran: the
    `error` of a line that did not run (same code), and a response with the `usage` it
    consumed."""
    body = error.body()
    body["usage"] = usage
    obj = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": error.status_code, "request_id": request_id, "body": body},
        "error": {"code": error.code, "message": error.message},
    }
    return _jsonl(obj)


def usage_object(
    endpoint: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The endpoint's own usage object for these counts."""
    if endpoint == "/v1/responses":
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return usage(prompt_tokens, completion_tokens, cached_tokens)


def answer_body(
    endpoint: str,
    body: dict[str, Any],
    model: ServedModel,
    call_id: str,
    results: list[ChoiceResult],
    prompt_tokens: int,
    cached_tokens: int,
    created: int,
    completion_tokens: int | None = None,
) -> dict[str, Any]:
    """The object the endpoint returns for these finished choices (no errors among them);
    `completion_tokens` defaults to the tokens of the choices."""
    parsed = validate_body(endpoint, body)
    if completion_tokens is None:
        completion_tokens = sum(len(r.token_ids) for r in results)
    tier = lane_for(parsed.service_tier)[1]  # as the endpoint reports it
    if isinstance(parsed, ResponsesRequest):
        plan = responses.output_plan(parsed, model)
        fmt = ResponsesFormat(call_id, parsed, tier, prompt_tokens, plan, model.tokenizer)
        fmt.created_at = created
        return fmt.final(results[0], completion_tokens, cached_tokens)
    usage_obj = usage(prompt_tokens, completion_tokens, cached_tokens)
    if isinstance(parsed, ChatCompletionRequest):
        chat_fmt = ChatFormat(call_id, model.name, created, tier, model.tokenizer)
        plan = chat.output_plan(parsed, model)  # tool calls and reasoning read as the route does
        return chat_fmt.completion(
            results, usage_obj, bool(parsed.logprobs), plan, parsed.prompt_logprobs
        )
    cmpl_fmt = CompletionFormat(call_id, model.name, created, tier, model.tokenizer)
    echo = completions.echo_texts(parsed, model)
    prompts = None
    if echo and parsed.logprobs is not None:  # the prompts' ids, as the line was built
        encoded = encode_prompts(model, parsed.prompt)
        prompts = [ids for ids in encoded for _ in range(parsed.n)]
    return cmpl_fmt.completion(
        results,
        usage_obj,
        parsed.logprobs is not None,
        False,
        echo,
        prompts,
        parsed.logprobs or 0,
        parsed.prompt_logprobs,
    )


def run_error(results: list[ChoiceResult]) -> APIError | None:
    """The error of the first choice that did not finish normally, as the endpoint raises it."""
    for result in results:
        error = error_for_finish(result.finish_reason or "error", result.error)
        if error is not None:
            return error
    return None
