"""Helpers that poll consumers in their own threads, as separate processes would."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from sluice.bus.base import Consumer, Record, TopicPartition


@dataclass
class Member:
    """A consumer polled by a background thread; records what it saw and was given."""

    consumer: Consumer
    commit: bool = True
    records: list[Record] = field(default_factory=list)
    assigned: set[TopicPartition] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> Member:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.consumer.poll(0.1)
                self.assigned = self.consumer.assignment()
                if batch:
                    self.records.extend(batch)
                    if self.commit:
                        offsets: dict[TopicPartition, int] = {}
                        for r in batch:
                            offsets[r.tp] = r.offset + 1
                        # A failed commit means a rebalance: these come again to someone.
                        with contextlib.suppress(Exception):
                            self.consumer.commit(offsets)
        except BaseException as exc:  # surfaced by halt()
            self.error = exc

    def halt(self, close: bool = True) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        if close:
            self.consumer.close()
        if self.error is not None:
            raise self.error
