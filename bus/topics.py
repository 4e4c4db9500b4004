"""Topic names and layout: which topics exist, their versions and partition counts.

docs/architecture.md §1, §4: requests split by priority lane and keyed by tenant, a control
topic for cancels, tokens back to the gateways, usage and telemetry for the side consumers, and a
dead-letter topic beside each input topic.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.bus.base import TopicSpec


class Lane(enum.StrEnum):
    """Priority lanes; `service_tier` priority/default/flex selects one."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"


def pool_id(model: str) -> str:
    """The topic-safe name of the pool serving `model` (its served name, base of its
    adapters): the name itself when it is [A-Za-z0-9_-]+, else its other characters as
    `_` and a short hash of the whole name, so `a.b` and `a_b` stay apart."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", model)
    if safe == model and model:
        return model
    return f"{safe[:80]}-{hashlib.sha1(model.encode()).hexdigest()[:8]}"


def request_topic(lane: Lane, pool: str) -> str:
    """`sluice.requests.<pool>.<lane>.v1`: each model pool has its own lanes, so one pool's
    backlog, lag and consumer group never touch another's (docs/architecture.md §4)."""
    return f"sluice.requests.{pool}.{lane.value}.v1"


def request_topics(pool: str) -> tuple[str, ...]:
    return tuple(request_topic(lane, pool) for lane in Lane)


_REQUEST_TOPIC = re.compile(r"sluice\.requests\.([A-Za-z0-9_-]+)\.(interactive|standard|batch)\.v1")


def parse_request_topic(topic: str) -> tuple[str, Lane] | None:
    """(pool, lane) of a request topic; None for any other topic."""
    match = _REQUEST_TOPIC.fullmatch(topic)
    return None if match is None else (match.group(1), Lane(match.group(2)))


CONTROL_TOPIC = "sluice.control.v1"
HEARTBEATS_TOPIC = "sluice.heartbeats.v1"  # gateways and engine workers say they live
TOKENS_TOPIC = "sluice.tokens.v1"
USAGE_TOPIC = "sluice.usage.v1"
TELEMETRY_TOPIC = "sluice.telemetry.v1"


def reply_topic(reply_to: str) -> str:
    """Where the deltas for one gateway instance go: `sluice.tokens.<reply_to>.v1`.

    Each gateway creates and reads its own reply topic, so it receives the deltas of its
    own streams only; `TOKENS_TOPIC` is the family name used for its dead letters.
    """
    if not reply_to or not all(c.isalnum() or c in "-_" for c in reply_to):
        raise ValueError(f"reply target must be [A-Za-z0-9_-]+, got {reply_to!r}")
    return f"sluice.tokens.{reply_to}.v1"


def dead_letter_topic(topic: str) -> str:
    """`sluice.usage.v1` → `sluice.usage.v1.dlq`."""
    return f"{topic}.dlq"


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """Partition counts per topic family; the composition root builds it from settings."""

    request_partitions: int = 6
    tokens_partitions: int = 6
    usage_partitions: int = 3
    telemetry_partitions: int = 1
    control_partitions: int = 1
    dead_letter_partitions: int = 1
    # the model pools whose request topics exist (`pool_id` of each served model)
    pools: tuple[str, ...] = ()

    def specs(self, pools: Iterable[str] = ()) -> list[TopicSpec]:
        """Every topic, with the request lanes of `self.pools` and of `pools`."""
        names = dict.fromkeys([*self.pools, *pools])
        requests = [t for pool in names for t in request_topics(pool)]
        specs = [TopicSpec(t, self.request_partitions) for t in requests]
        specs += [
            TopicSpec(CONTROL_TOPIC, self.control_partitions),
            TopicSpec(HEARTBEATS_TOPIC, 1),
            TopicSpec(TOKENS_TOPIC, self.tokens_partitions),
            TopicSpec(USAGE_TOPIC, self.usage_partitions),
            TopicSpec(TELEMETRY_TOPIC, self.telemetry_partitions),
        ]
        inputs = [*requests, CONTROL_TOPIC, TOKENS_TOPIC, USAGE_TOPIC, TELEMETRY_TOPIC]
        specs += [TopicSpec(dead_letter_topic(t), self.dead_letter_partitions) for t in inputs]
        return specs
