"""Which gateways are gone, as an engine worker sees it, so their requests stop billing.

A gateway that dies (kill -9, a lost host) leaves its requests running into a reply topic
nobody reads: the tenant would pay for every token up to `max_tokens` of a stream its
client never got. Each gateway publishes a `Heartbeat` every `heartbeat_s` on
`sluice.heartbeats.v1`, and so does each engine worker; a worker cancels the requests of
a gateway it heard before and has not heard for `ttl_s` (billed for what was generated
until then, as a client's disconnect is). A gateway that parks streams for a client to
resume (on any gateway: `api.resume`) says how long on its heartbeat; its requests get
that much longer, so a stream whose gateway died can still be taken over by another.
That one names the requests it took over on its own heartbeats (`follows`): they run on
while it is heard, and the dead gateway's others are cancelled as before.

Silence alone is not death: a broker outage silences every gateway at once. So a gateway
is judged only while the heartbeat stream flows: the worker heard its own heartbeat
within two intervals, and has heard heartbeats without a gap for `ttl_s`, so every
live gateway had the time to be heard again after an outage. A gateway this worker never
heard is judged the same way when its requests say it beats (`reply_beats`): a worker
that started after the gateway died (a pool scaling up from zero) would otherwise run
its waiting requests to the end for nobody. Reply targets that send no heartbeat (the
batches collector, bulk) are never judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sluice.bus.messages import Heartbeat, WorkerLoad


class GatewayLiveness:
    def __init__(
        self,
        worker_id: str,
        heartbeat_s: float,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        forget_after_s: float = 3600.0,
        pool: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.pool = pool  # named in this worker's own beats
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._forget_after_s = forget_after_s
        # gateway id → when last heard, and how long past the ttl its streams wait
        self._gateways: dict[str, tuple[float, float]] = {}
        self._followed: dict[str, float] = {}  # request id → when a gateway last named it
        self._own_heard = -float("inf")  # this worker's heartbeat came back (the stream flows)
        self._flowing_since = clock()
        self._last_heard = -float("inf")  # any heartbeat
        self._last_sent = -float("inf")

    def heard(self, beat: Heartbeat) -> None:
        now = self._clock()
        if now - self._last_heard > 2 * self.heartbeat_s:
            self._flowing_since = now  # after a silence, every gateway gets a new ttl
        self._last_heard = now
        if beat.role == "gateway":
            self._gateways[beat.sender_id] = (now, beat.resume_window_ms / 1000)
            for request_id in beat.follows:
                self._followed[request_id] = now
        elif beat.sender_id == self.worker_id:
            self._own_heard = now

    def due(self) -> bool:
        """Time for this worker's own heartbeat (the caller publishes it)."""
        now = self._clock()
        if self.ttl_s <= 0 or now - self._last_sent < self.heartbeat_s:
            return False
        self._last_sent = now
        return True

    def own_beat(self, load: WorkerLoad | None = None) -> Heartbeat:
        return Heartbeat(
            sender_id=self.worker_id,
            role="worker",
            interval_ms=int(self.heartbeat_s * 1000),
            load=load,
            pool=self.pool,
        )

    def judging(self) -> bool:
        """The heartbeat stream flows (see the module docstring): silence means death."""
        now = self._clock()
        return (
            self.ttl_s > 0
            and now - self._own_heard <= 2 * self.heartbeat_s
            and now - self._flowing_since >= self.ttl_s
        )

    def never_heard(self, gateway: str) -> bool:
        """`gateway` was not heard since this worker listens (gone, while `judging`)."""
        return gateway not in self._gateways

    def followed(self, request_id: str) -> bool:
        """Another gateway took this request's stream over and was heard within the ttl."""
        heard = self._followed.get(request_id)
        return heard is not None and self._clock() - heard <= self.ttl_s

    def gone(self) -> set[str]:
        """The gateways heard before and silent for `ttl_s` (plus their resume window)
        while the stream flows."""
        now = self._clock()
        if not self.judging():
            return set()
        for gateway, (heard, _) in list(self._gateways.items()):
            if now - heard > self._forget_after_s:
                del self._gateways[gateway]
        for request_id, heard in list(self._followed.items()):
            if now - heard > self.ttl_s:
                del self._followed[request_id]
        return {
            g
            for g, (heard, window_s) in self._gateways.items()
            if now - heard > self.ttl_s + window_s
        }
