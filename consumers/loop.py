"""The shared consume loop: poll → decode → handle → commit, for every consumer.

Each consumer is a `Handler` (message → effects); this loop owns polling, decoding,
retries with backoff, dead-lettering, commits and shutdown. Checkpoint order (as in Quix
Streams): effects of a batch first, then dead-letter publishes confirmed, then offsets
committed — so a crash anywhere redelivers, never skips (docs/architecture.md §5.2).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from sluice.bus.base import Consumer, Delivered, EventBus, Record, TopicPartition
from sluice.bus.codec import decode
from sluice.bus.errors import BusError, CommitFailed, DecodeError
from sluice.bus.messages import Message
from sluice.bus.topics import dead_letter_topic
from sluice.tracing.metrics import LagReporter, count_dead_letter

logger = logging.getLogger(__name__)


class Handler(Protocol):
    """Turns one decoded message into effects. Must be idempotent: delivery is at least once.

    Raise an exception with `retryable = False` for a message that can never succeed;
    any other exception is retried with backoff, then dead-lettered.
    """

    def handle(self, message: Message, record: Record) -> None: ...


Decoder = Callable[[Record], Message]


def decode_record(record: Record) -> Message:
    return decode(record.topic, record.value)


@dataclass(frozen=True, slots=True)
class LoopConfig:
    max_attempts: int = 5
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    poll_timeout_s: float = 0.5
    max_records: int = 500


@dataclass(slots=True)
class LoopStats:
    handled: int = 0
    retries: int = 0
    dead_lettered: int = 0
    commits: int = 0
    commit_failures: int = 0
    last_errors: list[str] = field(default_factory=list)


class ConsumeLoop:
    """Runs one handler over one consumer group until `stop()` (or SIGTERM)."""

    def __init__(
        self,
        bus: EventBus,
        group_id: str,
        topics: Sequence[str],
        handler: Handler,
        *,
        config: LoopConfig | None = None,
        decoder: Decoder = decode_record,
    ) -> None:
        self.bus = bus
        self.group_id = group_id
        self.topics = list(topics)
        self.handler = handler
        self.config = config or LoopConfig()
        self.decoder = decoder
        self.stats = LoopStats()
        self._lag = LagReporter(group_id, self.topics)
        self._stop = threading.Event()
        self._consumer: Consumer | None = None

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Poll and handle until stopped; commit what was handled; leave the group."""
        self._consumer = self.bus.consumer(self.group_id, self.topics)
        logger.info("consume loop started group=%s topics=%s", self.group_id, self.topics)
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self._consumer.close()
            self._consumer = None
            logger.info("consume loop stopped group=%s stats=%s", self.group_id, self.stats)

    def run_once(self) -> int:
        """One poll → handle → commit cycle; returns the number of records handled."""
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("run_once outside run(): no consumer")
        records = consumer.poll(self.config.poll_timeout_s, self.config.max_records)
        self._lag.refresh(lambda: consumer.lag())  # every ~2 s, as the poll left it
        next_offsets: dict[TopicPartition, int] = {}
        handled = 0
        for record in records:
            if self._stop.is_set() and handled:
                break  # shutting down: commit what is done, leave the rest for the group
            try:
                self._process(record)
            except _Abandon:
                break
            next_offsets[record.tp] = record.offset + 1
            handled += 1
        self._commit(consumer, next_offsets)
        return handled

    def _process(self, record: Record) -> None:
        try:
            message = self.decoder(record)
        except DecodeError as exc:
            self._dead_letter(record, f"decode: {exc}", attempts=0)
            return
        attempt = 0
        delay = self.config.backoff_initial_s
        while True:
            attempt += 1
            try:
                self.handler.handle(message, record)
                self.stats.handled += 1
                return
            except Exception as exc:
                permanent = getattr(exc, "retryable", True) is False
                if permanent or attempt >= self.config.max_attempts or self._stop.is_set():
                    if self._stop.is_set() and not permanent:
                        # Shutting down mid-retry: do not dead-letter a message that may
                        # still succeed; leave it uncommitted for the next member.
                        raise _Abandon from exc
                    self._dead_letter(record, f"{type(exc).__name__}: {exc}", attempt)
                    return
                self.stats.retries += 1
                logger.warning(
                    "handler failed, retrying group=%s topic=%s offset=%s attempt=%s: %s",
                    self.group_id,
                    record.topic,
                    record.offset,
                    attempt,
                    exc,
                )
                self._stop.wait(delay)
                delay = min(delay * 2, self.config.backoff_max_s)

    def _dead_letter(self, record: Record, reason: str, attempts: int) -> None:
        # Wait for the broker's confirmation: the offset is committed right after.
        publish_dead_letter(self.bus, record, reason, attempts).result(timeout=30)
        self.stats.dead_lettered += 1
        self.stats.last_errors = [*self.stats.last_errors[-9:], reason]
        logger.error(
            "dead-lettered group=%s topic=%s partition=%s offset=%s: %s",
            self.group_id,
            record.topic,
            record.partition,
            record.offset,
            reason,
        )

    def _commit(self, consumer: Consumer, offsets: dict[TopicPartition, int]) -> None:
        if not offsets:
            return
        try:
            consumer.commit(offsets)
            self.stats.commits += 1
        except CommitFailed as exc:
            # The group moved on; these records will be delivered again to the new owner.
            self.stats.commit_failures += 1
            logger.warning("commit failed group=%s: %s", self.group_id, exc)
        except BusError as exc:
            self.stats.commit_failures += 1
            logger.warning("commit failed group=%s: %s", self.group_id, exc)


def publish_dead_letter(
    bus: EventBus, record: Record, reason: str, attempts: int
) -> Future[Delivered]:
    """Copy `record` to its topic's dead-letter topic, with why and where it came from."""
    headers = [
        *record.headers,
        ("sluice-dlq-reason", reason[:1000].encode()),
        ("sluice-dlq-source", f"{record.topic}/{record.partition}/{record.offset}".encode()),
        ("sluice-dlq-attempts", str(attempts).encode()),
    ]
    future = bus.publish(
        dead_letter_topic(record.topic), record.value, key=record.key, headers=headers
    )
    future.add_done_callback(lambda f: _count_dead_letter(f, record.topic))
    return future


def _count_dead_letter(future: Future[Delivered], topic: str) -> None:
    if not future.cancelled() and future.exception() is None:
        count_dead_letter(topic)


class _Abandon(Exception):
    """Internal: stop handling the batch without committing the current record."""


def run_until_signalled(loop: ConsumeLoop) -> None:
    """Run `loop` in this (main) thread; SIGTERM and SIGINT stop it cleanly."""

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %s: draining group=%s", signum, loop.group_id)
        loop.stop()

    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, _on_signal)
    try:
        loop.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
