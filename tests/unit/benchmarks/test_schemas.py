"""The schema suite of `sluice bench structured`: every schema compiles with llguidance
against SmolLM2's tokenizer, and every example validates against its schema and is what
the compiled grammar accepts, token by token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from benchmarks.schemas import SCHEMAS, SchemaCase, by_name, ll_tokenizer
from sluice.engine.model_files import load_tokenizer
from sluice.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizers(gguf: Path) -> tuple[Tokenizer, Any]:
    tokenizer = load_tokenizer(gguf)
    return tokenizer, ll_tokenizer(tokenizer)


def test_the_suite_has_fifty_distinct_schemas() -> None:
    names = [case.name for case in SCHEMAS]
    assert len(names) >= 50 and len(set(names)) == len(names)
    assert by_name("invoice_extraction").schema["required"]


def _has(schema: Any, key: str) -> bool:
    if isinstance(schema, dict):
        return key in schema or any(_has(v, key) for v in schema.values())
    if isinstance(schema, list):
        return any(_has(v, key) for v in schema)
    return False


def test_the_suite_covers_the_schema_features() -> None:
    schemas = [case.schema for case in SCHEMAS]
    for key in ("$ref", "$defs", "anyOf", "oneOf", "enum", "const", "pattern", "format"):
        assert any(_has(s, key) for s in schemas), key
    for key in ("minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum"):
        assert any(_has(s, key) for s in schemas), key
    assert any(s.get("additionalProperties") is False for s in schemas)


@pytest.mark.parametrize("case", SCHEMAS, ids=lambda case: case.name)
def test_schema_compiles_and_accepts_its_example(
    case: SchemaCase, tokenizers: tuple[Tokenizer, Any]
) -> None:
    tokenizer, lltok = tokenizers
    validator = jsonschema.Draft202012Validator(
        case.schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    validator.check_schema(case.schema)
    validator.validate(case.example)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(case.schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    assert not is_error and messages == []
    matcher = llguidance.LLMatcher(lltok, grammar)
    text = json.dumps(case.example, separators=(",", ":"))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
