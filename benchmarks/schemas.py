"""A suite of realistic JSON schemas for structured outputs, each with one valid instance.

What `sluice bench structured` constrains its requests with and what the schema tests
compile: flat and nested objects, arrays with item bounds, enums and const, `$defs` and
`$ref` (recursive ones too), anyOf/oneOf, string patterns and lengths, number ranges,
the formats llguidance checks (date, time, date-time, email, uuid), strict objects (every
property required, no others), the schemas the openai SDK's `parse` sends for pydantic
models (`to_strict_json_schema`), extraction targets and tool-call arguments.

Every schema compiles with llguidance, and every `example` validates against its schema
(tests/unit/benchmarks/test_schemas.py).
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from openai.lib._pydantic import to_strict_json_schema

__all__ = ["SCHEMAS", "SchemaCase", "by_name", "ll_tokenizer"]

Schema = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    schema: Schema
    example: Any  # an instance the schema accepts


def _obj(
    props: dict[str, Schema], required: list[str] | None = None, strict: bool = False
) -> Schema:
    """An object schema; `strict`: every property required and no others (OpenAI's strict
    mode), else `required` (default: all)."""
    schema: Schema = {"type": "object", "properties": props}
    schema["required"] = list(props) if strict or required is None else required
    if strict:
        schema["additionalProperties"] = False
    return schema


def _s(**kw: Any) -> Schema:
    return {"type": "string", **kw}


def _i(**kw: Any) -> Schema:
    return {"type": "integer", **kw}


def _n(**kw: Any) -> Schema:
    return {"type": "number", **kw}


def _a(items: Schema, **kw: Any) -> Schema:
    return {"type": "array", "items": items, **kw}


_B: Schema = {"type": "boolean"}
_ENUM_CONDITION = {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]}

_ADDRESS = _obj(
    {
        "street": _s(minLength=1, maxLength=80),
        "city": _s(minLength=1, maxLength=40),
        "postal_code": _s(pattern=r"^[0-9]{5}$"),
        "country": _s(pattern=r"^[A-Z]{2}$"),
    },
    strict=True,
)
_PERSON = _obj({"name": _s(maxLength=60), "age": _i(minimum=0, maximum=150)})
_ADDRESS_EXAMPLE = {
    "street": "1 Main St",
    "city": "Springfield",
    "postal_code": "12345",
    "country": "US",
}


# -- pydantic models, as the openai SDK's `parse` sends them -------------------------------


class _Role(enum.StrEnum):
    ADMIN = "admin"
    EDITOR = "editor"
    VIEWER = "viewer"


class _PAddress(pydantic.BaseModel):
    street: str
    city: str
    zip_code: str = pydantic.Field(pattern=r"^\d{5}$")


class _PUser(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=50)
    email: str
    role: _Role
    address: _PAddress
    nickname: str | None = None


class _PLineItem(pydantic.BaseModel):
    description: str
    quantity: int = pydantic.Field(ge=1)
    unit_price: float = pydantic.Field(ge=0)


class _PInvoice(pydantic.BaseModel):
    invoice_number: str
    issued: dt.date
    vendor: _PAddress
    items: list[_PLineItem]
    total: float
    paid: bool


class _PEvent(pydantic.BaseModel):
    title: str
    kind: Literal["meeting", "call", "deadline"]
    starts_at: dt.datetime
    attendees: list[str]
    location: str | None


class _PCategory(pydantic.BaseModel):
    name: str
    subcategories: list[_PCategory]


class _PStep(pydantic.BaseModel):
    explanation: str
    output: str


class _PMathReasoning(pydantic.BaseModel):
    steps: list[_PStep]
    final_answer: str


class _PPlainProduct(pydantic.BaseModel):
    id: uuid.UUID
    name: str
    price: float = pydantic.Field(gt=0)
    tags: list[str] = pydantic.Field(default_factory=list, max_length=5)
    dimensions: dict[str, float] | None = None


def _strict(model: type[pydantic.BaseModel]) -> Schema:
    return to_strict_json_schema(model)


# -- the suite -------------------------------------------------------------------------------

SCHEMAS: list[SchemaCase] = [
    # flat objects
    SchemaCase("person_basic", _PERSON, {"name": "Ada", "age": 36}),
    SchemaCase(
        "flat_all_types",
        _obj({"s": _s(), "i": _i(), "n": _n(), "b": _B, "z": {"type": "null"}}),
        {"s": "x", "i": -3, "n": 2.5, "b": True, "z": None},
    ),
    SchemaCase(
        "user_profile_strict",
        _obj(
            {"username": _s(), "display_name": _s(), "verified": _B, "followers": _i(minimum=0)},
            strict=True,
        ),
        {"username": "ada", "display_name": "Ada L.", "verified": False, "followers": 12},
    ),
    SchemaCase(
        "product",
        _obj(
            {
                "id": _i(minimum=1),
                "name": _s(),
                "price": _n(minimum=0),
                "in_stock": _B,
                "note": _s(),
            },
            required=["id", "name", "price", "in_stock"],
        ),
        {"id": 7, "name": "Lamp", "price": 19.99, "in_stock": True},
    ),
    SchemaCase(
        "geo_point",
        _obj(
            {"lat": _n(minimum=-90, maximum=90), "lon": _n(minimum=-180, maximum=180)}, strict=True
        ),
        {"lat": 48.8566, "lon": 2.3522},
    ),
    SchemaCase(
        "color_rgb",
        _obj({c: _i(minimum=0, maximum=255) for c in "rgb"}, strict=True),
        {"r": 255, "g": 128, "b": 0},
    ),
    SchemaCase(
        "sentiment",
        _obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "score": _n(minimum=0, maximum=1),
            },
            strict=True,
        ),
        {"label": "positive", "score": 0.92},
    ),
    SchemaCase(
        "classification_multi",
        _obj(
            {
                "labels": _a(
                    {"enum": ["billing", "bug", "feature", "question", "spam"]},
                    minItems=1,
                    maxItems=3,
                ),
                "urgent": _B,
            },
            strict=True,
        ),
        {"labels": ["bug", "billing"], "urgent": True},
    ),
    SchemaCase(
        "versioned_envelope",
        _obj({"version": {"const": "1.0"}, "kind": {"const": "status"}, "ok": _B}, strict=True),
        {"version": "1.0", "kind": "status", "ok": True},
    ),
    SchemaCase(
        "yes_no_answer",
        _obj({"answer": {"enum": ["yes", "no"]}, "reason": _s(maxLength=200)}, strict=True),
        {"answer": "no", "reason": "The store is closed on Sundays."},
    ),
    # strings: patterns, lengths, formats
    SchemaCase(
        "username_pattern",
        _obj({"username": _s(pattern=r"^[a-z][a-z0-9_]{2,15}$")}, strict=True),
        {"username": "ada_l99"},
    ),
    SchemaCase(
        "phone_number",
        _obj(
            {
                "phone": _s(pattern=r"^\+[1-9][0-9]{7,14}$"),
                "kind": {"enum": ["mobile", "home", "work"]},
            }
        ),
        {"phone": "+14155550123", "kind": "mobile"},
    ),
    SchemaCase(
        "zip_code",
        _obj({"zip": _s(pattern=r"^[0-9]{5}(-[0-9]{4})?$")}, strict=True),
        {"zip": "94103-1234"},
    ),
    SchemaCase(
        "hex_color",
        _obj({"name": _s(maxLength=20), "hex": _s(pattern=r"^#[0-9a-fA-F]{6}$")}, strict=True),
        {"name": "teal", "hex": "#008080"},
    ),
    SchemaCase(
        "bounded_strings",
        _obj(
            {
                "title": _s(minLength=3, maxLength=40),
                "code": _s(minLength=4, maxLength=4),
                "memo": _s(maxLength=10),
            }
        ),
        {"title": "Quarterly report", "code": "Q3FY", "memo": ""},
    ),
    SchemaCase(
        "iso_dates",
        _obj(
            {"day": _s(format="date"), "at": _s(format="time"), "when": _s(format="date-time")},
            strict=True,
        ),
        {"day": "2024-05-17", "at": "09:30:00Z", "when": "2024-05-17T09:30:00Z"},
    ),
    SchemaCase(
        "contact_email",
        _obj({"name": _s(), "email": _s(format="email")}, strict=True),
        {"name": "Ada", "email": "ada@example.com"},
    ),
    SchemaCase(
        "uuid_record",
        _obj(
            {
                "id": _s(format="uuid"),
                "parent_id": {"anyOf": [_s(format="uuid"), {"type": "null"}]},
            },
            strict=True,
        ),
        {"id": "123e4567-e89b-12d3-a456-426614174000", "parent_id": None},
    ),
    SchemaCase(
        "sku_code",
        _obj(
            {"sku": _s(pattern=r"^[A-Z]{3}-[0-9]{4}$"), "qty": _i(minimum=1, maximum=999)},
            strict=True,
        ),
        {"sku": "LMP-0042", "qty": 3},
    ),
    # numbers
    SchemaCase(
        "temperature_reading",
        _obj(
            {
                "celsius": _n(minimum=-90, maximum=60),
                "humidity": _n(exclusiveMinimum=0, maximum=100),
                "sensor": _i(),
            },
            strict=True,
        ),
        {"celsius": 21.5, "humidity": 40, "sensor": 3},
    ),
    SchemaCase(
        "star_rating",
        _obj({"stars": _i(minimum=1, maximum=5), "would_recommend": _B}, strict=True),
        {"stars": 4, "would_recommend": True},
    ),
    SchemaCase(
        "percentages",
        _obj(
            {
                "cpu": _n(minimum=0, maximum=100),
                "memory": _n(minimum=0, maximum=100),
                "disk": _i(minimum=0, maximum=100),
            }
        ),
        {"cpu": 12.5, "memory": 73, "disk": 40},
    ),
    # arrays
    SchemaCase(
        "tag_list",
        _obj({"tags": _a(_s(minLength=1, maxLength=20), minItems=1, maxItems=5)}, strict=True),
        {"tags": ["python", "llm"]},
    ),
    SchemaCase(
        "matrix_2x2",
        _obj({"m": _a(_a(_n(), minItems=2, maxItems=2), minItems=2, maxItems=2)}, strict=True),
        {"m": [[1, 0], [0, 1.5]]},
    ),
    SchemaCase(
        "top3_scores",
        _a(_obj({"name": _s(), "score": _i(minimum=0)}, strict=True), minItems=3, maxItems=3),
        [{"name": "a", "score": 9}, {"name": "b", "score": 7}, {"name": "c", "score": 5}],
    ),
    SchemaCase(
        "todo_list",
        _obj(
            {
                "todos": _a(
                    _obj(
                        {"task": _s(), "done": _B, "priority": {"enum": ["low", "medium", "high"]}}
                    ),
                    maxItems=10,
                )
            },
            strict=True,
        ),
        {"todos": [{"task": "write tests", "done": False, "priority": "high"}]},
    ),
    SchemaCase(
        "tuple_record",
        _obj(
            {
                "row": {
                    "type": "array",
                    "prefixItems": [_s(), _i(), _B],
                    "items": False,
                    "minItems": 3,
                }
            },
            strict=True,
        ),
        {"row": ["x", 1, True]},
    ),
    SchemaCase(
        "number_list",
        _a(_n(minimum=0), minItems=1, maxItems=8),
        [1, 2.5, 3],
    ),
    # nested objects
    SchemaCase("address", _ADDRESS, _ADDRESS_EXAMPLE),
    SchemaCase(
        "person_with_address",
        _obj({"name": _s(), "age": _i(minimum=0, maximum=150), "address": _ADDRESS}, strict=True),
        {"name": "Ada", "age": 36, "address": _ADDRESS_EXAMPLE},
    ),
    SchemaCase(
        "company",
        _obj({"name": _s(), "hq": _ADDRESS, "employees": _a(_PERSON, maxItems=5)}, strict=True),
        {"name": "Acme", "hq": _ADDRESS_EXAMPLE, "employees": [{"name": "Bo", "age": 40}]},
    ),
    SchemaCase(
        "order",
        _obj(
            {
                "order_id": _s(pattern=r"^ORD-[0-9]{6}$"),
                "customer": _obj({"name": _s(), "email": _s(format="email")}, strict=True),
                "items": _a(
                    _obj({"sku": _s(), "qty": _i(minimum=1), "price": _n(minimum=0)}, strict=True),
                    minItems=1,
                    maxItems=20,
                ),
                "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
            },
            strict=True,
        ),
        {
            "order_id": "ORD-000123",
            "customer": {"name": "Ada", "email": "ada@example.com"},
            "items": [{"sku": "LMP-0042", "qty": 2, "price": 19.99}],
            "status": "paid",
        },
    ),
    # extraction targets
    SchemaCase(
        "invoice_extraction",
        _obj(
            {
                "invoice_number": _s(),
                "date": _s(format="date"),
                "vendor": _obj({"name": _s(), "address": _ADDRESS}, strict=True),
                "line_items": _a(
                    _obj(
                        {"description": _s(), "quantity": _n(minimum=0), "amount": _n()},
                        strict=True,
                    ),
                    minItems=1,
                ),
                "tax": _n(minimum=0),
                "total": _n(),
                "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
            },
            strict=True,
        ),
        {
            "invoice_number": "INV-7",
            "date": "2024-01-31",
            "vendor": {"name": "Acme", "address": _ADDRESS_EXAMPLE},
            "line_items": [{"description": "Consulting", "quantity": 3, "amount": 300}],
            "tax": 24,
            "total": 324,
            "currency": "EUR",
        },
    ),
    SchemaCase(
        "person_extraction",
        _obj(
            {
                "full_name": _s(),
                "birth_date": {"anyOf": [_s(format="date"), {"type": "null"}]},
                "occupation": {"anyOf": [_s(), {"type": "null"}]},
                "nationalities": _a(_s(pattern=r"^[A-Z]{2}$"), maxItems=3),
            },
            strict=True,
        ),
        {
            "full_name": "Ada Lovelace",
            "birth_date": "1815-12-10",
            "occupation": None,
            "nationalities": ["GB"],
        },
    ),
    SchemaCase(
        "address_extraction",
        _obj({"addresses": _a(_ADDRESS, maxItems=4)}, strict=True),
        {"addresses": [_ADDRESS_EXAMPLE]},
    ),
    SchemaCase(
        "event_extraction",
        _obj(
            {
                "title": _s(),
                "start": _s(format="date-time"),
                "end": _s(format="date-time"),
                "location": _obj({"venue": _s(), "city": _s()}, strict=True),
                "attendees": _a(_s(format="email"), maxItems=10),
                "recurring": _B,
            },
            strict=True,
        ),
        {
            "title": "Standup",
            "start": "2024-03-01T09:00:00Z",
            "end": "2024-03-01T09:15:00Z",
            "location": {"venue": "Room 4", "city": "Berlin"},
            "attendees": ["a@example.com", "b@example.org"],
            "recurring": True,
        },
    ),
    SchemaCase(
        "product_list_extraction",
        _obj(
            {
                "products": _a(
                    _obj(
                        {
                            "name": _s(),
                            "price": _n(minimum=0),
                            "currency": {"enum": ["USD", "EUR"]},
                            "rating": {"anyOf": [_n(minimum=0, maximum=5), {"type": "null"}]},
                        },
                        strict=True,
                    ),
                    minItems=1,
                    maxItems=10,
                )
            },
            strict=True,
        ),
        {"products": [{"name": "Lamp", "price": 19.99, "currency": "USD", "rating": 4.5}]},
    ),
    SchemaCase(
        "resume",
        _obj(
            {
                "name": _s(),
                "skills": _a(_s(), maxItems=10),
                "experience": _a(
                    _obj(
                        {
                            "company": _s(),
                            "role": _s(),
                            "start_year": _i(minimum=1950, maximum=2100),
                        },
                        strict=True,
                    ),
                    maxItems=5,
                ),
                "education": _a(
                    _obj(
                        {"school": _s(), "degree": {"enum": ["BSc", "MSc", "PhD", "other"]}},
                        strict=True,
                    )
                ),
            },
            strict=True,
        ),
        {
            "name": "Ada",
            "skills": ["math"],
            "experience": [{"company": "Engines Ltd", "role": "analyst", "start_year": 1990}],
            "education": [{"school": "Home", "degree": "other"}],
        },
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "title": _s(),
                "servings": _i(minimum=1, maximum=20),
                "ingredients": _a(
                    _obj(
                        {
                            "item": _s(),
                            "amount": _n(minimum=0),
                            "unit": {"enum": ["g", "ml", "tsp", "tbsp", "cup", "piece"]},
                        },
                        strict=True,
                    ),
                    minItems=1,
                ),
                "steps": _a(_s(minLength=1), minItems=1),
            },
            strict=True,
        ),
        {
            "title": "Tea",
            "servings": 1,
            "ingredients": [{"item": "water", "amount": 250, "unit": "ml"}],
            "steps": ["Boil water.", "Steep 3 minutes."],
        },
    ),
    SchemaCase(
        "weather_forecast",
        _obj(
            {
                "city": _s(),
                "days": _a(
                    _obj(
                        {
                            "date": _s(format="date"),
                            "high": _n(),
                            "low": _n(),
                            "condition": _ENUM_CONDITION,
                        },
                        strict=True,
                    ),
                    minItems=1,
                    maxItems=7,
                ),
            },
            strict=True,
        ),
        {
            "city": "Oslo",
            "days": [{"date": "2024-02-01", "high": -1, "low": -8.5, "condition": "snow"}],
        },
    ),
    SchemaCase(
        "movie_review",
        _obj(
            {
                "title": _s(),
                "year": _i(minimum=1888, maximum=2100),
                "rating": _n(minimum=0, maximum=10),
                "pros": _a(_s(), maxItems=3),
                "cons": _a(_s(), maxItems=3),
                "verdict": {"enum": ["watch", "skip", "maybe"]},
            },
            strict=True,
        ),
        {
            "title": "Metropolis",
            "year": 1927,
            "rating": 9,
            "pros": ["visuals"],
            "cons": [],
            "verdict": "watch",
        },
    ),
    SchemaCase(
        "meeting_notes",
        _obj(
            {
                "summary": _s(maxLength=300),
                "decisions": _a(_s()),
                "action_items": _a(
                    _obj(
                        {
                            "owner": _s(),
                            "task": _s(),
                            "due": {"anyOf": [_s(format="date"), {"type": "null"}]},
                        },
                        strict=True,
                    )
                ),
            },
            strict=True,
        ),
        {
            "summary": "Planned the release.",
            "decisions": ["ship Friday"],
            "action_items": [{"owner": "Bo", "task": "tag the build", "due": "2024-06-07"}],
        },
    ),
    SchemaCase(
        "bank_transaction",
        _obj(
            {
                "id": _s(format="uuid"),
                "amount": _n(),
                "currency": _s(pattern=r"^[A-Z]{3}$"),
                "direction": {"enum": ["debit", "credit"]},
                "booked_on": _s(format="date"),
                "counterparty": {"anyOf": [_s(), {"type": "null"}]},
            },
            strict=True,
        ),
        {
            "id": "9b2f6f3e-6c1a-4b8e-9d2a-3f4e5d6c7b8a",
            "amount": -42.1,
            "currency": "EUR",
            "direction": "debit",
            "booked_on": "2024-04-02",
            "counterparty": "Grocer",
        },
    ),
    SchemaCase(
        "flight_booking",
        _obj(
            {
                "passenger": _PERSON,
                "from": _s(pattern=r"^[A-Z]{3}$"),
                "to": _s(pattern=r"^[A-Z]{3}$"),
                "departure": _s(format="date-time"),
                "class": {"enum": ["economy", "premium", "business", "first"]},
                "bags": _i(minimum=0, maximum=3),
            }
        ),
        {
            "passenger": {"name": "Ada", "age": 36},
            "from": "LHR",
            "to": "JFK",
            "departure": "2024-07-01T10:05:00Z",
            "class": "economy",
            "bags": 1,
        },
    ),
    SchemaCase(
        "lab_result",
        _obj(
            {
                "test": _s(),
                "value": _n(),
                "unit": _s(maxLength=10),
                "reference_range": _obj({"low": _n(), "high": _n()}, strict=True),
                "flag": {"enum": ["low", "normal", "high"]},
            },
            strict=True,
        ),
        {
            "test": "glucose",
            "value": 5.4,
            "unit": "mmol/L",
            "reference_range": {"low": 3.9, "high": 5.6},
            "flag": "normal",
        },
    ),
    # $defs and $ref
    SchemaCase(
        "shipping_and_billing_refs",
        {
            "$defs": {"address": _ADDRESS},
            **_obj(
                {"billing": {"$ref": "#/$defs/address"}, "shipping": {"$ref": "#/$defs/address"}},
                strict=True,
            ),
        },
        {"billing": _ADDRESS_EXAMPLE, "shipping": _ADDRESS_EXAMPLE},
    ),
    SchemaCase(
        "tree_node_recursive",
        {
            "$defs": {
                "node": _obj(
                    {"value": _i(), "children": _a({"$ref": "#/$defs/node"}, maxItems=3)},
                    strict=True,
                )
            },
            "$ref": "#/$defs/node",
        },
        {
            "value": 1,
            "children": [
                {"value": 2, "children": []},
                {"value": 3, "children": [{"value": 4, "children": []}]},
            ],
        },
    ),
    SchemaCase(
        "linked_list_recursive",
        {
            "$defs": {
                "cell": _obj(
                    {"head": _s(), "tail": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}},
                    strict=True,
                )
            },
            "$ref": "#/$defs/cell",
        },
        {"head": "a", "tail": {"head": "b", "tail": None}},
    ),
    SchemaCase(
        "comment_thread_recursive",
        {
            "$defs": {
                "comment": _obj(
                    {
                        "author": _s(),
                        "text": _s(maxLength=280),
                        "replies": _a({"$ref": "#/$defs/comment"}, maxItems=5),
                    },
                    strict=True,
                )
            },
            **_obj({"post_id": _i(), "comments": _a({"$ref": "#/$defs/comment"})}, strict=True),
        },
        {
            "post_id": 1,
            "comments": [
                {
                    "author": "a",
                    "text": "hi",
                    "replies": [{"author": "b", "text": "hey", "replies": []}],
                }
            ],
        },
    ),
    # anyOf / oneOf
    SchemaCase(
        "payment_method_oneof",
        _obj(
            {
                "payment": {
                    "oneOf": [
                        _obj(
                            {
                                "type": {"const": "card"},
                                "last4": _s(pattern=r"^[0-9]{4}$"),
                                "expiry": _s(pattern=r"^[0-9]{2}/[0-9]{2}$"),
                            },
                            strict=True,
                        ),
                        _obj(
                            {
                                "type": {"const": "bank"},
                                "iban": _s(pattern=r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"),
                            },
                            strict=True,
                        ),
                        _obj(
                            {"type": {"const": "paypal"}, "email": _s(format="email")}, strict=True
                        ),
                    ]
                }
            },
            strict=True,
        ),
        {"payment": {"type": "bank", "iban": "DE89370400440532013000"}},
    ),
    SchemaCase(
        "shape_anyof",
        {
            "anyOf": [
                _obj({"kind": {"const": "circle"}, "radius": _n(minimum=0)}, strict=True),
                _obj(
                    {"kind": {"const": "rect"}, "w": _n(minimum=0), "h": _n(minimum=0)}, strict=True
                ),
            ]
        },
        {"kind": "rect", "w": 2, "h": 3.5},
    ),
    SchemaCase(
        "nullable_fields",
        _obj(
            {
                "nickname": {"type": ["string", "null"]},
                "age": {"anyOf": [_i(minimum=0), {"type": "null"}]},
                "score": {"type": ["number", "null"]},
            },
            strict=True,
        ),
        {"nickname": None, "age": 30, "score": None},
    ),
    SchemaCase(
        "search_results_mixed",
        _obj(
            {
                "results": _a(
                    {
                        "anyOf": [
                            _obj(
                                {"type": {"const": "web"}, "url": _s(), "title": _s()}, strict=True
                            ),
                            _obj(
                                {
                                    "type": {"const": "image"},
                                    "url": _s(),
                                    "width": _i(),
                                    "height": _i(),
                                },
                                strict=True,
                            ),
                        ]
                    },
                    maxItems=5,
                )
            },
            strict=True,
        ),
        {"results": [{"type": "web", "url": "https://example.com", "title": "Example"}]},
    ),
    # tool-call arguments
    SchemaCase(
        "tool_get_weather",
        _obj({"location": _s(), "unit": {"enum": ["celsius", "fahrenheit"]}}, strict=True),
        {"location": "Paris, FR", "unit": "celsius"},
    ),
    SchemaCase(
        "tool_search_web",
        _obj(
            {"query": _s(minLength=1), "num_results": _i(minimum=1, maximum=10), "site": _s()},
            required=["query"],
        ),
        {"query": "llguidance", "num_results": 3},
    ),
    SchemaCase(
        "tool_send_email",
        _obj(
            {
                "to": _a(_s(format="email"), minItems=1, maxItems=5),
                "cc": _a(_s(format="email"), maxItems=5),
                "subject": _s(maxLength=100),
                "body": _s(),
            },
            strict=True,
        ),
        {"to": ["bo@example.com"], "cc": [], "subject": "Hi", "body": "See you at 5."},
    ),
    SchemaCase(
        "tool_call_envelope",
        {
            "oneOf": [
                _obj(
                    {
                        "name": {"const": "get_weather"},
                        "arguments": _obj({"city": _s()}, strict=True),
                    },
                    strict=True,
                ),
                _obj(
                    {
                        "name": {"const": "create_ticket"},
                        "arguments": _obj(
                            {"title": _s(), "severity": {"enum": ["low", "high"]}}, strict=True
                        ),
                    },
                    strict=True,
                ),
            ]
        },
        {"name": "create_ticket", "arguments": {"title": "Login fails", "severity": "high"}},
    ),
    SchemaCase(
        "tool_parallel_calls",
        _a(
            _obj(
                {
                    "name": {"enum": ["lookup", "convert"]},
                    "arguments": _obj({"input": _s()}, strict=True),
                },
                strict=True,
            ),
            minItems=1,
            maxItems=3,
        ),
        [
            {"name": "lookup", "arguments": {"input": "EUR"}},
            {"name": "convert", "arguments": {"input": "10 EUR"}},
        ],
    ),
    # pydantic models through the openai SDK (strict) and as pydantic writes them
    SchemaCase(
        "pydantic_user",
        _strict(_PUser),
        {
            "name": "Ada",
            "email": "ada@example.com",
            "role": "editor",
            "address": {"street": "1 Main St", "city": "Springfield", "zip_code": "12345"},
            "nickname": None,
        },
    ),
    SchemaCase(
        "pydantic_invoice",
        _strict(_PInvoice),
        {
            "invoice_number": "A-1",
            "issued": "2024-05-01",
            "vendor": {"street": "1 Main St", "city": "Springfield", "zip_code": "12345"},
            "items": [{"description": "widget", "quantity": 2, "unit_price": 2.5}],
            "total": 5.0,
            "paid": False,
        },
    ),
    SchemaCase(
        "pydantic_event",
        _strict(_PEvent),
        {
            "title": "Sync",
            "kind": "call",
            "starts_at": "2024-05-01T15:00:00Z",
            "attendees": ["Ada", "Bo"],
            "location": None,
        },
    ),
    SchemaCase(
        "pydantic_category_tree",
        _strict(_PCategory),
        {"name": "root", "subcategories": [{"name": "leaf", "subcategories": []}]},
    ),
    SchemaCase(
        "pydantic_math_reasoning",
        _strict(_PMathReasoning),
        {"steps": [{"explanation": "add", "output": "2+2=4"}], "final_answer": "4"},
    ),
    SchemaCase(
        "pydantic_plain_product",
        _PPlainProduct.model_json_schema(),
        {
            "id": "123e4567-e89b-12d3-a456-426614174000",
            "name": "Lamp",
            "price": 19.5,
            "tags": ["home"],
        },
    ),
    # the loosest: any object (what json_object asks for)
    SchemaCase("any_object", {"type": "object"}, {"anything": [1, "two", None]}),
]


def by_name(name: str) -> SchemaCase:
    for case in SCHEMAS:
        if case.name == name:
            return case
    raise KeyError(name)


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of one of our tokenizers (`engine.tokenizer.Tokenizer`)."""
    import llguidance

    return llguidance.LLTokenizer(
        tokenizer._tok.to_str(),
        n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_token_ids),
    )
