"""Output constraints at the gateway: the request's fields → one `StructuredSpec`, checked.

Chat's `response_format`, Responses' `text.format`, and vLLM's extras (`structured_outputs`,
`guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`) all become one
`StructuredSpec`; at most one constraint per request. `check_compiles` asks the engine's
grammar compiler (handed in by the composition root on `ServedModel`) whether the
constraint compiles against the served model's vocabulary, so a bad schema, regex or
grammar is a 400 naming its field rather than an engine failure mid-batch.
"""

from __future__ import annotations

import json
from typing import Any

from sluice.api.errors import InvalidRequest
from sluice.api.served import ServedModel
from sluice.bus.messages import StructuredSpec

# vLLM's `structured_outputs` keys → StructuredSpec kinds
_STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code="invalid_value")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):  # vLLM takes the schema as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _invalid(param, f"not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise _invalid(param, "a JSON schema must be an object")
    return json.dumps(schema, separators=(",", ":"))


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json_object":
        return StructuredSpec(kind="json_object")
    if kind == "json_schema":
        return StructuredSpec(kind="json_schema", value=_schema_text(value, param))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise _invalid(param, "must be a non-empty list of non-empty strings")
        return StructuredSpec(kind="choice", value=json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _invalid(param, "must be a non-empty string")
    return StructuredSpec(kind=kind, value=value)  # type: ignore[arg-type]


def response_format_spec(fmt: dict[str, Any] | None, param: str) -> StructuredSpec | None:
    """Chat's `response_format` (and Responses' `text.format`, flat: name and schema at its
    top level); None for text."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(kind="json_object")
    if kind != "json_schema":
        raise _invalid(f"{param}.type", f"must be text, json_object or json_schema, got {kind!r}")
    inner = fmt.get("json_schema", fmt)  # chat nests it; Responses' text.format is flat
    if not isinstance(inner, dict):
        raise _invalid(f"{param}.json_schema", "must be an object")
    where = f"{param}.json_schema.schema" if "json_schema" in fmt else f"{param}.schema"
    schema = inner.get("schema")
    if schema is None:
        schema = {}  # OpenAI: no schema is any JSON
    return _spec("json_schema", schema, where)


def constrained(body: Any) -> bool:
    """Whether a chat or completions body sets an output constraint (building it compiles
    one, off the event loop)."""
    return bool(
        getattr(body, "response_format", None)
        or getattr(body, "structured_outputs", None)
        or any(getattr(body, key, None) is not None for key in _GUIDED)
    )


def request_spec(body: Any) -> tuple[StructuredSpec | None, str | None]:
    """The one constraint of a chat or completions body and the param that set it; a 400
    when more than one is set."""
    found: list[tuple[StructuredSpec, str]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        spec = response_format_spec(fmt, "response_format")
        if spec is not None:
            nested = spec.kind == "json_schema" and "json_schema" in fmt
            found.append(
                (spec, "response_format.json_schema.schema" if nested else "response_format")
            )
    so = getattr(body, "structured_outputs", None) or {}
    for key, kind in _STRUCTURED_KEYS.items():
        value = so.get(key)
        if value is None or value is False:
            continue
        param = f"structured_outputs.{key}"
        found.append((_spec(kind, value, param), param))
    for key, kind in _GUIDED.items():
        value = getattr(body, key, None)
        if value is not None:
            found.append((_spec(kind, value, key), key))
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise InvalidRequest(
            f"set one output constraint per request, got {names}",
            param=found[1][1],
            code="invalid_value",
        )
    return found[0] if found else (None, None)


def check_compiles(model: ServedModel, spec: StructuredSpec, param: str) -> None:
    """400 naming `param` when the constraint cannot compile for this model (the engine's
    own check, `ServedModel.check_constraint`). Takes milliseconds, and the tokenizer's
    view on first use: call it off the event loop."""
    if model.check_constraint is None:
        return
    try:
        model.check_constraint(spec.kind, spec.value)
    except ValueError as exc:
        raise InvalidRequest(
            f"{param}: the {spec.kind.replace('_', ' ')} cannot be compiled: {str(exc)[:500]}",
            param=param,
            code="invalid_value",
        ) from None
