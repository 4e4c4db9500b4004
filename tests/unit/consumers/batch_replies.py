"""The engine's side of a batch, played by a test: token deltas for a batch's lines on the
batch reply topic, for the collector tests on the memory bus and on Kafka alike."""

from __future__ import annotations

from typing import Any

from sluice.bus.base import EventBus
from sluice.bus.codec import encode
from sluice.bus.messages import TokenDelta, TokenDeltaBatch, Usage
from sluice.bus.topics import reply_topic
from sluice.consumers.batches.lines import BATCH_REPLY_TARGET, line_call_id

TOPIC = reply_topic(BATCH_REPLY_TARGET)


def delta(
    batch_id: str, line: int, attempt: int, seq: int, offset: int, text: str, **kw: Any
) -> TokenDelta:
    """One character per token, so token and text offsets agree; a delta with a
    `finish_reason` carries the line's usage (3 prompt tokens, one per character)."""
    index = kw.pop("index", 0)
    suffix = f"-{index}" if index else ""
    if kw.get("finish_reason"):
        kw["usage"] = Usage(prompt_tokens=3, completion_tokens=offset + len(text))
    return TokenDelta(
        request_id=f"req_{line_call_id(batch_id, line)}{suffix}",
        attempt=attempt,
        seq_no=seq,
        token_offset=offset,
        text_offset=offset,
        token_ids=[ord(c) for c in text],
        text=text,
        **kw,
    )


def publish(bus: EventBus, *deltas: TokenDelta) -> int:
    """One record (one engine step's deltas); its offset."""
    message = TokenDeltaBatch(reply_to=BATCH_REPLY_TARGET, deltas=list(deltas))
    return bus.publish(TOPIC, encode(message), key=BATCH_REPLY_TARGET.encode()).result(10).offset
