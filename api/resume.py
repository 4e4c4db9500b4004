"""Resumable streams: SSE event ids, and the streams a gateway keeps for a client to resume.

Every event of a chat, completions or responses stream carries an `id:` that names
where the stream stands: the call, per choice the completion tokens read (and whether
its finish was read), and how many events went out since those last changed
(`<call>:<tokens>[f],…:<i>`). A client whose connection dropped sends the same request
again with `Last-Event-ID`; the gateway reads the call's events again from the first
through the same formatting, silently up to that id, and sends what follows, then the
live rest. Nothing is published again, so the call is billed once. A Responses stream
kept in the response store resumes through its store instead (`api.stored_responses`,
ids `<response id>:<sequence_number>`).

A stream's connection that ends, whether or not every event went out, parks it for
`resume_window_s`; the generation keeps running meanwhile (bounded by its max_tokens and
deadline). Not resumed within the window, what still runs is cancelled as a disconnect
is, billed for what ran, and the stream is forgotten. A window of 0 cancels at the
disconnect.

With a directory shared by the deployment's gateways (`storage.streams`, Redis in a
fleet), a resume may come to any gateway, also after the one that ran the stream was
killed: the gateway that finds no such stream of its own looks it up there and claims
it, and the route rebuilds the call with its id and follows its deltas on the reply
topic they go to (`GatewayService.adopt`), from the first, through the same formatting:
the replay stops at the same id. A parked stream another gateway claimed is left to it
at the end of its window rather than cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.api.errors import Conflict, InvalidRequest, NotFound, ServiceUnavailable
from sluice.api.generation import Generation
from sluice.storage.errors import StoreError
from sluice.storage.streams import StreamDirectory, StreamRecord

logger = logging.getLogger(__name__)

# how long a resume waits for the connection it replaces to be noticed as gone
TAKEOVER_WAIT_S = 5.0
_PARAM = "Last-Event-ID"


@dataclass(frozen=True, slots=True)
class EventId:
    """Where a stream stood when it sent an event (see the module docstring)."""

    call_id: str
    tokens: tuple[int, ...]
    finished: tuple[bool, ...]
    num_since: int  # events sent since `tokens`/`finished` last changed, this one included

    def __str__(self) -> str:
        choices = ",".join(
            f"{t}{'f' if f else ''}" for t, f in zip(self.tokens, self.finished, strict=True)
        )
        return f"{self.call_id}:{choices}:{self.num_since}"

    @classmethod
    def parse(cls, raw: str) -> EventId:
        try:
            call_id, choices, num = raw.strip().split(":")
            parts = choices.split(",")
            tokens = tuple(int(p.removesuffix("f")) for p in parts)
            finished = tuple(p.endswith("f") for p in parts)
            num_since = int(num)
        except ValueError:
            raise InvalidRequest(
                f"{_PARAM} {raw[:80]!r} is not an event id of this server",
                param=_PARAM,
                code="invalid_value",
            ) from None
        if not call_id or num_since < 1 or min(tokens) < 0:
            raise InvalidRequest(
                f"{_PARAM} {raw[:80]!r} is not an event id of this server",
                param=_PARAM,
                code="invalid_value",
            )
        return cls(call_id, tokens, finished, num_since)


class EventIds:
    """Frames a stream's events with their ids; when resuming, drops those up to the
    client's last one. Reads the generation's read counts, so each event must be framed
    right after the generation event it comes from was read."""

    def __init__(self, call_id: str, generation: Generation, after: EventId | None) -> None:
        self._call_id = call_id
        self._generation = generation
        self._after = after
        self._state: tuple[tuple[int, ...], tuple[bool, ...]] = ((), ())
        self._num_since = 0

    @property
    def replaying(self) -> bool:
        return self._after is not None

    def frame(self, event: str) -> str | None:
        """`event` (an SSE event's text) with its `id:` line; None while replaying."""
        g = self._generation
        state = (tuple(g.read_tokens), tuple(g.read_finished))
        if state != self._state:
            self._state, self._num_since = state, 0
        self._num_since += 1
        current = EventId(self._call_id, state[0], state[1], self._num_since)
        after = self._after
        if after is not None:
            if current == after:
                self._after = None  # the client's last event: what follows is new to it
                return None
            if not _past(current, after):
                return None
            # a position the replay never stood at: the id was not of this stream's events
            logger.warning("resume point %s not met, sending from %s", after, current)
            self._after = None
        return f"id: {current}\n{event}"


def _past(current: EventId, after: EventId) -> bool:
    return any(
        t > a or (f and not af)
        for t, a, f, af in zip(
            current.tokens, after.tokens, current.finished, after.finished, strict=True
        )
    )


@dataclass(eq=False, slots=True)
class ResumableStream:
    """One stream a client may resume: what it was asked, and its live generation."""

    call_id: str
    tenant_id: str
    request_key: Any  # path and body: a resume must ask the same
    generation: Generation
    # the stream's SSE events from the generation's first, through a fresh formatter:
    # each reader (the first, one that took over) calls it once
    events: Callable[[], AsyncIterator[str]]
    attached: bool = True
    detached: asyncio.Event = field(default_factory=asyncio.Event)
    expiry: asyncio.TimerHandle | None = None


def check_choices(event_id: EventId, generation: Generation) -> None:
    """400 unless `event_id` names as many choices as the stream has."""
    if len(event_id.tokens) != len(generation.tracks):
        raise InvalidRequest(
            f"{_PARAM} {str(event_id)[:80]!r} is not an event id of this stream",
            param=_PARAM,
            code="invalid_value",
        )


def request_digest(request_key: Any) -> str:
    """What a resume on another gateway compares: the request key, hashed."""
    text = json.dumps(request_key, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class ResumableStreams:
    """The streams of one gateway that a client may still resume, by call id; with a
    `directory`, also those another gateway ran (`find_elsewhere`)."""

    def __init__(
        self, window_s: float, gateway_id: str = "", directory: StreamDirectory | None = None
    ) -> None:
        self.window_s = window_s
        self.gateway_id = gateway_id
        self.directory = directory  # set before the first stream opens
        self._streams: dict[str, ResumableStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._streams)

    def open(
        self,
        call_id: str,
        tenant_id: str,
        request_key: Any,
        generation: Generation,
        events: Callable[[], AsyncIterator[str]],
        record: StreamRecord | None = None,
    ) -> ResumableStream:
        """A new stream, attached to its first connection; its events are kept. `record`
        (where its deltas go, who serves it) is written to the directory, if any."""
        stream = ResumableStream(call_id, tenant_id, request_key, generation, events)
        if self.window_s > 0:  # with no window nothing resumes: no events to keep
            generation.keep_log()
            self._streams[call_id] = stream
            directory = self.directory
            if directory is not None and record is not None:
                self._spawn(_quietly(directory.put, record))
        return stream

    async def find_elsewhere(
        self, event_id: EventId, tenant_id: str, request_key: Any
    ) -> StreamRecord:
        """The stream `event_id` belongs to, run by another gateway, now claimed by this
        one: the caller rebuilds the call and follows it. NotFound without one."""
        if self.directory is None:
            raise _not_found(event_id)
        try:
            record = await asyncio.to_thread(self.directory.get, event_id.call_id)
            if record is None or record.tenant_id != tenant_id or record.owner == self.gateway_id:
                # another tenant's reads as one that does not exist
                raise _not_found(event_id, shared=True)
            if record.request_digest != request_digest(request_key):
                raise _another_request()
            if not await asyncio.to_thread(self.directory.claim, record, self.gateway_id):
                raise Conflict("this stream was resumed on another connection")
        except StoreError as exc:
            logger.warning("stream directory unavailable: %s", exc)
            raise ServiceUnavailable("resuming streams is unavailable; retry shortly") from exc
        logger.info(
            "stream claimed call_id=%s tenant_id=%s from %s",
            record.call_id,
            tenant_id,
            record.owner,
        )
        return record

    def detach(self, stream: ResumableStream, resumable: bool = True) -> None:
        """Its connection ended: parked for the window, even when every event went out
        (sent is not received: a connection that broke loses what it had in flight);
        with no window, or not `resumable`, cancelled at once."""
        stream.attached = False
        stream.detached.set()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # finalized with no loop left (shutdown): no one can resume
            loop = None
        if self.window_s <= 0 or loop is None or not resumable:
            self._forget(stream)
            stream.generation.abandon()
            return
        if stream.generation.pending:
            logger.info(
                "stream parked request_id=%s tenant_id=%s for %.0fs",
                stream.generation.request_id,
                stream.tenant_id,
                self.window_s,
            )
        stream.expiry = loop.call_later(self.window_s, self._expire, stream)

    async def resume(self, event_id: EventId, tenant_id: str, request_key: Any) -> ResumableStream:
        """Take over the stream `event_id` belongs to, for a new connection."""
        stream = self._streams.get(event_id.call_id)
        if stream is None or stream.tenant_id != tenant_id:
            # another tenant's stream reads as one that does not exist
            raise _not_found(event_id)
        if stream.request_key != request_key:
            raise _another_request()
        check_choices(event_id, stream.generation)
        if self.directory is not None:
            await self._reclaim(stream, self.directory)
        if stream.attached:
            try:
                async with asyncio.timeout(TAKEOVER_WAIT_S):
                    await stream.detached.wait()
            except TimeoutError:
                raise Conflict(
                    "this stream is still being sent on another connection; close it first"
                ) from None
        if stream.attached:  # another resume took it while this one waited
            raise Conflict("this stream was resumed on another connection")
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        stream.attached = True
        stream.detached = asyncio.Event()
        stream.generation.rewind()
        logger.info(
            "stream resumed request_id=%s tenant_id=%s after %s",
            stream.generation.request_id,
            tenant_id,
            event_id,
        )
        return stream

    async def _reclaim(self, stream: ResumableStream, directory: StreamDirectory) -> None:
        """A parked stream another gateway took over meanwhile comes back to this one,
        which still runs it: that one leaves its copy running at its window's end."""
        try:
            record = await asyncio.to_thread(directory.get, stream.call_id)
            if record is None or record.owner == self.gateway_id:
                return
            if not await asyncio.to_thread(directory.claim, record, self.gateway_id):
                raise Conflict("this stream was resumed on another connection")
        except StoreError as exc:  # this gateway runs it: resumed here all the same
            logger.warning("stream directory unavailable: %s", exc)

    def has(self, call_id: str) -> bool:
        return call_id in self._streams

    def _expire(self, stream: ResumableStream) -> None:
        stream.expiry = None
        if stream.attached:
            return
        if self.directory is not None:
            self._spawn(self._expire_shared(stream, self.directory))
            return
        self._end(stream)

    async def _expire_shared(self, stream: ResumableStream, directory: StreamDirectory) -> None:
        """Cancelled as `_end` does unless another gateway claimed it: it runs on there."""
        try:
            record = await asyncio.to_thread(directory.get, stream.call_id)
        except StoreError as exc:
            logger.warning("stream directory unavailable: %s", exc)
            record = None
        if stream.attached:  # resumed here meanwhile
            return
        if record is not None and record.owner != self.gateway_id:
            self._forget(stream)
            logger.info(
                "stream left to gateway %s request_id=%s",
                record.owner,
                stream.generation.request_id,
            )
            return
        self._end(stream)
        await _quietly(directory.drop, stream.call_id, self.gateway_id)

    def _end(self, stream: ResumableStream) -> None:
        self._forget(stream)
        if stream.generation.pending:
            logger.info(
                "stream not resumed within %.0fs request_id=%s",
                self.window_s,
                stream.generation.request_id,
            )
        stream.generation.abandon()  # cancels what still runs; billed for what ran

    def _forget(self, stream: ResumableStream) -> None:
        if self._streams.get(stream.call_id) is stream:
            del self._streams[stream.call_id]
        stream.generation.drop_log()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)


async def _quietly(fn: Callable[..., None], *args: Any) -> None:
    """A directory write off the loop; one that fails costs a resume elsewhere only."""
    try:
        await asyncio.to_thread(fn, *args)
    except StoreError as exc:
        logger.warning("stream directory unavailable: %s", exc)


def _not_found(event_id: EventId, shared: bool = False) -> NotFound:
    return not_resumable(str(event_id), shared)


def not_resumable(last_event_id: str, shared: bool = False) -> NotFound:
    """404 for a `Last-Event-ID` whose stream this gateway cannot resume."""
    where = "" if shared else ", or it ran on another gateway"
    return NotFound(
        f"no stream to resume for {_PARAM} {last_event_id[:80]!r}: it ended, its resume"
        f" window passed{where}",
        param=_PARAM,
        code="stream_not_found",
    )


def _another_request() -> InvalidRequest:
    return InvalidRequest(
        f"{_PARAM} belongs to a stream of another request; send the same request"
        " again to resume it",
        param=_PARAM,
        code="invalid_value",
    )
