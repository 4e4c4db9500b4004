"""`GatewayService`: publishes GenerateRequests and routes the engine's deltas back.

The gateway's half of the bus (docs/architecture.md §1, §11): a request is published to
its lane topic, keyed by tenant, with the trace context in the headers; the engine workers answer on
this instance's own reply topic, which one thread polls. That thread hands each batch to
the event loop (`call_soon_threadsafe`), where the per-request bookkeeping lives, so it
needs no lock:

- fencing: a delta of a lower attempt than the highest seen is dropped;
- duplicates: a (attempt, seq_no) at or below the last one taken is dropped;
- dedupe across a failover: token_offset/text_offset are absolute positions in the
  completion, so the part of a delta before what the client already has is cut off;
- terminals: with a hook (`watch_terminals`, used for quota settlement), the first
  terminal delta of every published sub-request is handed to it, also after the client
  went away or the deadline passed (the engine answers the Cancel with usage);
- no engine up: once a worker answered that none is up (`api.engine_verdict`), a call
  waits briefly for its first delta and is refused 503 from `submit` when that says so
  too, before a stream has answered 200;
- taken-over streams: a stream resumed here whose gateway died (`adopt`) is followed on
  that gateway's reply topic (`api.follow`), its deltas routed as this gateway's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from sluice.api.engine_verdict import EngineVerdict
from sluice.api.errors import EngineUnavailable, ServiceUnavailable
from sluice.api.follow import ReplyFollower
from sluice.api.generation import Generation, Track, accept
from sluice.api.resume import ResumableStreams
from sluice.api.server_span import note_generation
from sluice.api.slo import SloPools
from sluice.bus.base import Consumer, EventBus, TopicPartition, TopicSpec
from sluice.bus.codec import decode_as, encode
from sluice.bus.errors import BusError
from sluice.bus.messages import Cancel, GenerateRequest, Heartbeat, TokenDelta, TokenDeltaBatch
from sluice.bus.topics import (
    CONTROL_TOPIC,
    HEARTBEATS_TOPIC,
    pool_id,
    reply_topic,
    request_topic,
)
from sluice.tracing.metrics import time_publish
from sluice.tracing.propagation import inject_headers
from sluice.tracing.spans import SendSpan

logger = logging.getLogger(__name__)

TerminalHook = Callable[[GenerateRequest, TokenDelta], None]
TERMINAL_WAIT_S = 3600.0  # how long a published request waits for its terminal delta
UNANSWERED_CANCEL_MAX_S = 3600.0  # a cancel is sent again at most this long (no deadline)
MAX_UNANSWERED_CANCELS = 10_000  # the rest wait for their deadline at the worker
PUBLISH_REPORT_GRACE_S = 2.0  # how long past the publish timeout the bus may take to say
REPLY_COMMIT_INTERVAL_S = 0.5  # a rejoining reply consumer re-reads at most this much


# seconds a request may wait for the bus to take it, and past its deadline for the engine
PUBLISH_TIMEOUT_S = 10.0
DEADLINE_GRACE_S = 5.0


class GatewayService:
    """Owns the reply consumer and the live requests of one gateway instance."""

    def __init__(
        self,
        bus: EventBus,
        *,
        gateway_id: str | None = None,
        reply_partitions: int = 1,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
        poll_timeout_s: float = 0.1,
        deadline_grace_s: float = DEADLINE_GRACE_S,
        heartbeat_s: float = 0.0,
        resume_window_s: float = 0.0,
    ) -> None:
        self.bus = bus
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.reply_topic = reply_topic(self.gateway_id)
        self.deadline_grace_s = deadline_grace_s
        # engine workers cancel a silent gateway's requests (`consumers.gateway_liveness`);
        # 0 sends none (a batch or bulk reply target, whose requests must run on)
        self.heartbeat_s = heartbeat_s
        self._beat_at = 0.0
        self._reply_partitions = reply_partitions
        self._publish_timeout_s = publish_timeout_s
        self._poll_timeout_s = poll_timeout_s
        self._tracks: dict[str, tuple[Track, Generation]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._assigned = threading.Event()
        self._ready = threading.Event()
        self._last_poll_ok = 0.0
        self._poll_error: str | None = None
        self._terminal_hook: TerminalHook | None = None
        self._awaiting: dict[str, tuple[GenerateRequest, float]] = {}
        # SLO admission (`api.slo`), set before `start`: it reads the workers' heartbeats
        self.slo: SloPools | None = None
        # streams a client whose connection dropped may resume (`Last-Event-ID`)
        # (with `streams.directory` set, also streams another gateway ran)
        self.streams = ResumableStreams(resume_window_s, self.gateway_id)
        self._followers: dict[str, ReplyFollower] = {}  # reply target → its follower
        self.verdict = EngineVerdict()  # whether a worker said that no engine is up
        # request id → (tenant, reason, monotonic deadline) of cancels no worker answered:
        # a request waiting in the topics of a pool with no worker meets the worker that
        # starts later, whose control consumer reads from its start on; so each is sent
        # again with every heartbeat until a terminal delta or the deadline
        self._unanswered_cancels: dict[str, tuple[str, str, float]] = {}
        self._cancels_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> None:
        """Create the reply topic, start the consumer thread, wait until it listens."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(
            self.bus.create_topics, [TopicSpec(self.reply_topic, self._reply_partitions)]
        )
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"reply-consumer-{self.gateway_id}", daemon=True
        )
        self._thread.start()
        ready = await asyncio.to_thread(self._ready.wait, timeout_s)
        if not ready:
            logger.warning("reply consumer not assigned after %.0fs", timeout_s)

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            self._thread = None
        for follower in self._followers.values():
            await asyncio.to_thread(follower.stop)
        self._followers.clear()
        generations = {id(g): g for _, g in self._tracks.values()}
        for generation in generations.values():
            generation.end("error", "gateway shutting down", "the gateway is shutting down")
        self._tracks.clear()

    @property
    def ready(self) -> bool:
        """Listening on the reply topic, and the last poll succeeded recently."""
        alive = self._thread is not None and self._thread.is_alive()
        recent = time.monotonic() - self._last_poll_ok < max(5.0, 20 * self._poll_timeout_s)
        return alive and self._ready.is_set() and recent

    @property
    def num_live_requests(self) -> int:
        return len(self._tracks)

    def watch_terminals(self, hook: TerminalHook) -> None:
        """Call `hook(request, delta)` on the event loop for each request's first terminal."""
        self._terminal_hook = hook

    def forget_terminals(self, requests: Sequence[GenerateRequest]) -> list[GenerateRequest]:
        """Stop waiting for these requests' terminals; returns those that were awaited."""
        return [e[0] for r in requests if (e := self._awaiting.pop(r.request_id, None))]

    # -- requests -------------------------------------------------------------------
    async def submit(
        self, requests: Sequence[GenerateRequest], deadline_ms: int | None
    ) -> Generation:
        """Publish the sub-requests of one call (n choices / several prompts).

        Tracks are registered before publishing so no early delta is missed; when a
        publish fails, the ones already sent are cancelled and 503 is raised. While a
        worker's word is that no engine is up, the call's first delta is awaited a
        little: when it says so too, EngineUnavailable (503) is raised.
        """
        generation = self._track(requests, deadline_ms)
        tenant_id = generation.tenant_id
        if self._terminal_hook is not None:
            self._await_terminals(requests)
        pool = generation.pool
        first = self.verdict.watch(requests[0].request_id, pool)
        refusal = None
        try:
            topic = request_topic(requests[0].lane, pool)  # one call: one model, one lane
            send = SendSpan(topic, tenant_id, requests[0].request_id, len(requests))
            headers = send.headers()
            if self.slo is not None:
                self.slo.published(requests)
            futures = [
                time_publish(  # sluice_bus_publish_seconds once the broker confirms it
                    self.bus.publish(topic, encode(r), key=r.tenant_id.encode(), headers=headers),
                    topic,
                )
                for r in requests
            ]
            send.end_when_sent(futures)
            # past the bus's own message timeout (the same setting), so that a publish that
            # failed there is reported by the bus, not guessed at here
            timeout_s = self._publish_timeout_s + PUBLISH_REPORT_GRACE_S
            async with asyncio.timeout(timeout_s):  # see Generation.next_event
                for future in futures:
                    await asyncio.wrap_future(future)
            if first is not None:
                refusal = await self.verdict.refusal(requests[0].request_id, first)
        except (BusError, TimeoutError) as exc:
            logger.warning(
                "publish failed request_id=%s tenant_id=%s: %s",
                requests[0].request_id,
                tenant_id,
                exc,
            )
            self.cancel(generation, reason="publish failed")
            raise ServiceUnavailable("the request queue is unavailable; retry shortly") from exc
        except BaseException:
            # nothing may stay tracked for a call that never got going (a cancelled
            # caller, an unencodable request): the caller releases what it admitted
            self.cancel(generation, reason="submit failed")
            raise
        finally:
            if first is not None:
                self.verdict.forget(requests[0].request_id)
        if refusal is not None:  # its terminal went to the hook: billed as the worker says
            self.cancel(generation, reason="no engine is up")
            raise EngineUnavailable(refusal)
        note_generation(list(requests), generation)  # its usage goes on the server span
        return generation

    def _track(self, requests: Sequence[GenerateRequest], deadline_ms: int | None) -> Generation:
        """A generation for `requests`, its deltas routed to it from now on."""
        tracks = [Track(index=i, request_id=r.request_id) for i, r in enumerate(requests)]
        wait_until = None
        if deadline_ms is not None:
            wait_until = time.monotonic() + deadline_ms / 1000 - time.time() + self.deadline_grace_s
        generation = Generation(
            tracks,
            tenant_id=requests[0].tenant_id,
            wait_until=wait_until,
            service=self,
            pool=pool_id(requests[0].model),
        )
        for track in tracks:
            self._tracks[track.request_id] = (track, generation)
        return generation

    def adopt(
        self,
        reply_to: str,
        requests: Sequence[GenerateRequest],
        deadline_ms: int | None,
        created_s: int | None = None,
    ) -> Generation:
        """Take over a stream another gateway published, its deltas going to `reply_to`:
        nothing is published; they are read again from that reply topic's start.
        `created_s`: the first gateway's `Generation.created`, which its chunks carry."""
        generation = self._track(requests, deadline_ms)
        if created_s:
            generation.created = created_s
        # also for this gateway's own reply target: its consumer started at the latest
        # offset and may have missed the first deltas (a restart under a fixed id)
        ids = [r.request_id for r in requests]
        follower = self._followers.get(reply_to)
        if follower is None or not follower.follow(ids):
            follower = ReplyFollower(
                self.bus,
                reply_to,
                gateway_id=self.gateway_id,
                hand_over=self._hand_over,
                tracked=self._tracks.__contains__,
                heartbeat_s=self.heartbeat_s,
                resume_window_s=self.streams.window_s,
                poll_timeout_s=self._poll_timeout_s,
            )
            follower.follow(ids)
            self._followers[reply_to] = follower
            follower.start()
        logger.info(
            "stream taken over request_id=%s tenant_id=%s from %s",
            requests[0].request_id,
            generation.tenant_id,
            reply_to,
        )
        return generation

    def cancel(self, generation: Generation, reason: str = "client disconnected") -> None:
        """Publish a Cancel for every unfinished sub-request and forget them; one that no
        worker answered yet is sent again until one does (see `_unanswered_cancels`)."""
        deadline = generation.wait_until or time.monotonic() + UNANSWERED_CANCEL_MAX_S
        for track in generation.tracks:
            if track.done:
                continue
            track.done = True
            self._tracks.pop(track.request_id, None)
            self._publish_cancel(track.request_id, generation.tenant_id, reason)
            if track.attempt < 0 and self.heartbeat_s > 0:
                with self._cancels_lock:
                    if len(self._unanswered_cancels) < MAX_UNANSWERED_CANCELS:
                        entry = (generation.tenant_id, reason, deadline)
                        self._unanswered_cancels[track.request_id] = entry

    def cancel_and_follow(self, generation: Generation, reason: str) -> None:
        """Publish a Cancel for every unfinished sub-request but keep routing its deltas:
        the engine's terminal delta (`abort`, with the tokens generated until the Cancel
        landed) still ends the generation, so its caller shows what the engine bills."""
        for track in generation.tracks:
            if not track.done:
                self._publish_cancel(track.request_id, generation.tenant_id, reason)

    def _publish_cancel(
        self, request_id: str, tenant_id: str, reason: str, again: bool = False
    ) -> None:
        message = Cancel(request_id=request_id, tenant_id=tenant_id, reason=reason)
        try:
            self.bus.publish(
                CONTROL_TOPIC, encode(message), key=tenant_id.encode(), headers=inject_headers()
            )
        except BusError as exc:  # the engine's deadline still bounds the waste
            logger.warning("cancel not published request_id=%s: %s", request_id, exc)
        if not again:
            logger.info("cancelled request_id=%s reason=%s", request_id, reason)

    def _await_terminals(self, requests: Sequence[GenerateRequest]) -> None:
        now = time.monotonic()
        if len(self._awaiting) > 10_000:  # terminals that never came (lost requests)
            self._awaiting = {k: v for k, v in self._awaiting.items() if v[1] > now}
        for r in requests:
            self._awaiting[r.request_id] = (r, now + TERMINAL_WAIT_S)

    # -- the reply consumer (its own thread) ------------------------------------------
    def _on_assign(self, partitions: set[TopicPartition]) -> None:
        self._assigned.set()

    def _run(self) -> None:
        consumer: Consumer | None = None
        # Where reading goes on: committed now and then, so a member that lost the group
        # (its session timed out while the broker was unreachable) rejoins where it was,
        # not at "latest" past every delta sent meanwhile; the redelivered ones are
        # dropped as duplicates by (attempt, seq_no).
        positions: dict[TopicPartition, int] = {}
        committed_at = 0.0
        while not self._stopping.is_set():
            try:
                if consumer is None:
                    group = f"gateway-{self.gateway_id}-{uuid.uuid4().hex[:8]}"
                    topics = [self.reply_topic]
                    if self.slo is not None:
                        topics.append(HEARTBEATS_TOPIC)  # the workers' load
                    consumer = self.bus.consumer(
                        group, topics, offset_reset="latest", on_assign=self._on_assign
                    )
                records = consumer.poll(self._poll_timeout_s)
                for record in records:
                    positions[record.tp] = record.offset + 1
                if positions and time.monotonic() - committed_at >= REPLY_COMMIT_INTERVAL_S:
                    consumer.commit(dict(positions), wait=False)
                    positions.clear()
                    committed_at = time.monotonic()
                self._last_poll_ok = time.monotonic()
                self._poll_error = None
                self._heartbeat()
                if self._assigned.is_set():
                    # positions resolve ("latest") in the poll that follows the assignment
                    self._ready.set()
            except BusError as exc:
                self._poll_error = str(exc)
                logger.warning("reply consumer poll failed: %s", exc)
                self._stopping.wait(1.0)
                continue
            batches = []
            for record in records:
                try:
                    if record.topic == HEARTBEATS_TOPIC:
                        if self.slo is not None:
                            self.slo.heard(decode_as(Heartbeat, record.value))
                        continue
                    batches.append(decode_as(TokenDeltaBatch, record.value))
                except BusError as exc:
                    logger.warning("undecodable reply at offset %s: %s", record.offset, exc)
            if batches:
                self._hand_over(batches)
        if consumer is not None:
            try:
                consumer.close()
            except BusError as exc:
                logger.warning("reply consumer close failed: %s", exc)

    def _heartbeat(self) -> None:
        """From the reply consumer's thread: a gateway that cannot read its replies
        cannot serve its requests either. Raises BusError."""
        now = time.monotonic()
        if self.heartbeat_s <= 0 or now - self._beat_at < self.heartbeat_s:
            return
        self._beat_at = now
        beat = Heartbeat(
            sender_id=self.gateway_id,
            role="gateway",
            interval_ms=int(self.heartbeat_s * 1000),
            resume_window_ms=int(self.streams.window_s * 1000),
        )
        self.bus.publish(HEARTBEATS_TOPIC, encode(beat), key=self.gateway_id.encode())
        if self._unanswered_cancels:
            with self._cancels_lock:
                for request_id, (_, _, deadline) in list(self._unanswered_cancels.items()):
                    if deadline < now:
                        del self._unanswered_cancels[request_id]
                again = list(self._unanswered_cancels.items())
            for request_id, (tenant_id, reason, _) in again:
                self._publish_cancel(request_id, tenant_id, reason, again=True)

    def _hand_over(self, batches: list[TokenDeltaBatch]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed since the check
            loop.call_soon_threadsafe(self._route, batches)

    # -- on the event loop -------------------------------------------------------------
    def _route(self, batches: list[TokenDeltaBatch]) -> None:
        for batch in batches:
            for delta in batch.deltas:
                if self._unanswered_cancels and delta.finish_reason is not None:
                    with self._cancels_lock:
                        self._unanswered_cancels.pop(delta.request_id, None)
                entry = self._tracks.get(delta.request_id)
                self.verdict.heard(delta, None if entry is None else entry[1].pool)
                if self.slo is not None:
                    self.slo.on_delta(delta)
                if delta.finish_reason is not None and self._awaiting:
                    self._terminal(delta)
                if entry is not None:
                    self._accept(entry[0], entry[1], delta)

    def _terminal(self, delta: TokenDelta) -> None:
        awaited = self._awaiting.pop(delta.request_id, None)
        if awaited is None or self._terminal_hook is None:
            return
        try:
            self._terminal_hook(awaited[0], delta)
        except Exception:  # settlement must never break the reply stream
            logger.exception("terminal hook failed request_id=%s", delta.request_id)

    def _accept(self, track: Track, generation: Generation, delta: TokenDelta) -> None:
        if not accept(track, delta):
            return
        generation.take(track, delta)
        if track.done:
            self._tracks.pop(track.request_id, None)
