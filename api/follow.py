"""Following another gateway's reply topic: the streams this gateway took over from it.

A stream's deltas go to the reply topic of the gateway it was published from, for its
whole run. When that gateway died and a client resumed the stream here (`api.resume`,
`storage.streams`), this gateway reads that topic from its start, so the taken-over
stream's deltas come again from its first (the generation keeps only what is new), and
names the requests it follows on heartbeats of its own: the engine workers, which cancel
the requests of a silent gateway (`consumers.gateway_liveness`), let those run on.
One thread per followed target; it stops once none of its requests is live.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from sluice.bus.base import Consumer, EventBus
from sluice.bus.codec import decode_as, encode
from sluice.bus.errors import BusError
from sluice.bus.messages import Heartbeat, TokenDeltaBatch
from sluice.bus.topics import HEARTBEATS_TOPIC, reply_topic

logger = logging.getLogger(__name__)


class ReplyFollower:
    """Reads `reply_to`'s reply topic from its start on its own thread; hands each poll's
    batches to `hand_over` and heartbeats as `gateway_id`, naming the requests it
    follows, while one of them is still `tracked`."""

    def __init__(
        self,
        bus: EventBus,
        reply_to: str,
        *,
        gateway_id: str,
        hand_over: Callable[[list[TokenDeltaBatch]], None],
        tracked: Callable[[str], bool],
        heartbeat_s: float,
        resume_window_s: float,
        poll_timeout_s: float = 0.1,
    ) -> None:
        self.reply_to = reply_to
        self._gateway_id = gateway_id
        self._bus = bus
        self._hand_over = hand_over
        self._tracked = tracked
        self._request_ids: set[str] = set()
        self._lock = threading.Lock()  # a request followed is never left by a stopping thread
        self._heartbeat_s = heartbeat_s
        self._resume_window_ms = int(resume_window_s * 1000)
        self._poll_timeout_s = poll_timeout_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"reply-follower-{reply_to}", daemon=True
        )

    def follow(self, request_ids: list[str]) -> bool:
        """Follow these requests too; False when this follower stopped (start another)."""
        with self._lock:
            if self._stopping.is_set():
                return False
            self._request_ids.update(request_ids)
        if self._thread.is_alive():
            self._beat()  # at once: the workers may be counting their gateway's silence down
        return True

    def _live(self) -> bool:
        with self._lock:
            self._request_ids = {i for i in self._request_ids if self._tracked(i)}
            if not self._request_ids:
                self._stopping.set()
            return not self._stopping.is_set()

    def start(self) -> None:
        self._beat()  # see `follow`
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        consumer: Consumer | None = None
        beat_at = time.monotonic()
        while not self._stopping.is_set() and self._live():
            try:
                if consumer is None:
                    group = f"follower-{self.reply_to}-{uuid.uuid4().hex[:8]}"
                    consumer = self._bus.consumer(
                        group, [reply_topic(self.reply_to)], offset_reset="earliest"
                    )
                records = consumer.poll(self._poll_timeout_s)
                if time.monotonic() - beat_at >= self._heartbeat_s > 0:
                    beat_at = time.monotonic()
                    self._beat()
            except BusError as exc:
                logger.warning("following reply target %s failed: %s", self.reply_to, exc)
                self._stopping.wait(1.0)
                continue
            batches = []
            for record in records:
                try:
                    batches.append(decode_as(TokenDeltaBatch, record.value))
                except BusError as exc:
                    logger.warning("undecodable reply at offset %s: %s", record.offset, exc)
            if batches:
                self._hand_over(batches)
        self._stopping.set()
        if consumer is not None:
            try:
                consumer.close()
            except BusError as exc:
                logger.warning("follower consumer close failed: %s", exc)

    def _beat(self) -> None:
        if self._heartbeat_s <= 0:
            return
        with self._lock:
            follows = sorted(self._request_ids)
        beat = Heartbeat(
            sender_id=self._gateway_id,
            role="gateway",
            interval_ms=int(self._heartbeat_s * 1000),
            resume_window_ms=self._resume_window_ms,
            follows=follows,
        )
        try:
            self._bus.publish(HEARTBEATS_TOPIC, encode(beat), key=self._gateway_id.encode())
        except BusError as exc:
            logger.warning("heartbeat following %s not published: %s", self.reply_to, exc)
