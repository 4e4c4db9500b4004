"""Bytes ↔ messages: compact JSON, one message type per topic.

Decoding failures raise `DecodeError` (permanent), which the consume loop sends straight
to the dead-letter topic.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError

from sluice.bus.errors import DecodeError
from sluice.bus.messages import (
    Cancel,
    GenerateRequest,
    Heartbeat,
    Message,
    TelemetryRecord,
    TokenDeltaBatch,
    UsageRecord,
)
from sluice.bus.topics import (
    CONTROL_TOPIC,
    HEARTBEATS_TOPIC,
    TELEMETRY_TOPIC,
    TOKENS_TOPIC,
    USAGE_TOPIC,
    parse_request_topic,
)

TOPIC_MESSAGES: dict[str, type[Message]] = {
    CONTROL_TOPIC: Cancel,
    HEARTBEATS_TOPIC: Heartbeat,
    TOKENS_TOPIC: TokenDeltaBatch,
    USAGE_TOPIC: UsageRecord,
    TELEMETRY_TOPIC: TelemetryRecord,
}


def encode(message: Message) -> bytes:
    """Compact JSON (no spaces); fields left at their defaults are kept for readers."""
    return message.model_dump_json().encode()


M = TypeVar("M", bound=Message)


def decode_as(model: type[M], value: bytes) -> M:
    try:
        return model.model_validate_json(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "message"
        raise DecodeError(f"not a valid {model.__name__}: {where}: {first['msg']}") from exc


def decode(topic: str, value: bytes) -> Message:
    """Decode with the message type registered for `topic` (request topics of every pool
    carry requests, reply topics deltas)."""
    model = TOPIC_MESSAGES.get(topic)
    if model is None and parse_request_topic(topic) is not None:
        model = GenerateRequest
    if model is None and topic.startswith("sluice.tokens.") and topic.endswith(".v1"):
        model = TokenDeltaBatch
    if model is None:
        raise DecodeError(f"no message type registered for topic {topic}")
    return decode_as(model, value)
