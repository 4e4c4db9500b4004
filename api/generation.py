"""One call's live generation: its sub-requests, deduplicated deltas, and the events out.

A call (one chat/completions/responses request) fans out into one sub-request per choice
(n > 1, or several prompts); `Generation` merges their deltas into one queue of
`StreamEvent`s tagged with the choice index. Positions are Python string indices (code
points) for text and token counts for tokens, both absolute across attempts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from pydantic import TypeAdapter

from sluice.bus.messages import (
    ENGINE_UNAVAILABLE,
    FinishReason,
    PromptLogprob,
    TokenDelta,
    TokenLogprob,
)

logger = logging.getLogger(__name__)


class GenerationCanceller(Protocol):
    """Cancels a generation's unfinished sub-requests on the bus (`GatewayService`);
    a protocol, so that the service imports this module and not the other way round."""

    def cancel(self, generation: Generation, reason: str = ...) -> None: ...


@dataclass(slots=True)
class Track:
    """Bookkeeping for one sub-request: what the client already has, from which attempt."""

    index: int
    request_id: str
    attempt: int = -1
    last_seq_no: int = -1
    num_tokens: int = 0
    num_chars: int = 0
    cached_tokens: int = 0
    done: bool = False
    # deltas of this attempt that came ahead of one still on its way (a publish the
    # worker had to retry lands after the next one): taken once the gap is filled
    held: list[TokenDelta] = field(default_factory=list)
    held_since: float = 0.0  # time.monotonic() when the open gap opened
    prompt_logprobs_taken: bool = False  # a redelivered first delta brings them again


@dataclass(slots=True)
class StreamEvent:
    """New output of choice `index`; `finish_reason` set on its last event."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # `TokenDelta.error_code`
    prompt_logprobs: list[PromptLogprob | None] | None = None  # on the choice's first event


@dataclass(slots=True)
class ChoiceResult:
    """A choice accumulated for a non-streaming answer."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None


_LOGPROBS: TypeAdapter[list[TokenLogprob]] = TypeAdapter(list[TokenLogprob])


@dataclass(frozen=True, slots=True)
class _Kept:
    """A read event as a resumable stream keeps it for a replay: its logprobs as one
    JSON string, not a model per alternative token (top_logprobs 20 makes a token
    some 20 objects, and thousands of kept tokens leave the heap grown after they go)."""

    event: StreamEvent
    logprobs: bytes | None

    @classmethod
    def of(cls, event: StreamEvent) -> _Kept:
        if event.logprobs is None:
            return cls(event, None)
        return cls(replace(event, logprobs=None), _LOGPROBS.dump_json(event.logprobs))

    def unpack(self) -> StreamEvent:
        if self.logprobs is None:
            return self.event
        return replace(self.event, logprobs=_LOGPROBS.validate_json(self.logprobs))


def _client_error(request_id: str, delta: TokenDelta) -> str | None:
    """A stable message for the client; the engine's own words go to the log only."""
    if delta.error is None:
        return None
    if delta.error_code == ENGINE_UNAVAILABLE:
        return delta.error  # the worker's words for the client: the cause and its fix
    logger.warning(
        "request failed in the engine request_id=%s attempt=%s: %s",
        request_id,
        delta.attempt,
        delta.error,
    )
    return (
        f"the engine failed while generating this request (request id {request_id}); "
        "retry, and quote the request id if it persists"
    )


# deltas held while a gap stays open, and for how long; past either the missing one is
# taken as lost and what is held goes out with its gap. Short: a reordering (a retried
# publish) closes its gap within this; a lost delta should cost the client little more
# than the gap itself (a broker that skips records is fetched again by the Kafka
# adapter: `bus.kafka._OffsetGaps`)
MAX_HELD = 256
GAP_WAIT_S = 2.0
_TIMER_SLACK_S = 0.001  # the loop runs a timer up to its clock's resolution early


def accept(track: Track, delta: TokenDelta) -> bool:
    """Fencing and duplicates: False for a delta of a lower attempt than one already
    seen, or at or below the last (attempt, seq_no) taken that holds nothing the client
    lacks. A lower seq_no may still bring tokens: the late delta that fills a gap, or the
    same attempt run again from the start by a worker that took the partition over with
    no shared progress store (no Redis); `Generation.take` keeps only what is new by
    offsets. True moves the track on."""
    if delta.attempt < track.attempt:
        logger.info(
            "fenced delta request_id=%s attempt=%s < %s",
            delta.request_id,
            delta.attempt,
            track.attempt,
        )
        return False
    if delta.attempt > track.attempt:
        track.attempt, track.last_seq_no = delta.attempt, -1
        track.held.clear()  # a dead attempt's: the new one resumes from its own offsets
    elif (
        delta.seq_no <= track.last_seq_no
        and not track.held
        and delta.token_offset + len(delta.token_ids) <= track.num_tokens
    ):
        return False  # redelivered: nothing the client lacks
    track.last_seq_no = max(track.last_seq_no, delta.seq_no)
    return True


class Generation:
    def __init__(
        self,
        tracks: list[Track],
        *,
        tenant_id: str,
        wait_until: float | None,
        service: GenerationCanceller,
        pool: str = "",
    ) -> None:
        self.tracks = tracks
        self.tenant_id = tenant_id
        self.pool = pool  # the model pool its requests went to
        self.wait_until = wait_until  # time.monotonic() after which we stop waiting
        self.created = int(time.time())
        self._service = service
        # the events not read yet, and the reader's wake-up while it waits for one: a
        # deque and a bare future rather than asyncio.Queue under asyncio.timeout, whose
        # futures, timer and loop look-ups per event are most of a stream's CPU at the
        # gateway; an event waiting here is read without a timer
        self._events: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # one timer per generation, moved on lazily (`_on_timer`), rather than one per
        # wait: a timer armed and cancelled per event costs the loop's heap more than
        # the rest of the event's handling
        self._due = 0.0  # loop time at which a waiting reader is woken without an event
        self._timer: asyncio.TimerHandle | None = None
        # a resumable stream keeps every event read, so that a reader that took over
        # (`rewind`) reads them again from the first before the live ones
        self._log: list[_Kept] | None = None
        self._replay: deque[_Kept] = deque()
        # per choice, the tokens and finish of the events read so far: what an SSE event
        # id names (`api.resume.EventIds`)
        self.read_tokens = [0] * len(tracks)
        self.read_finished = [False] * len(tracks)

    @property
    def request_id(self) -> str:
        return self.tracks[0].request_id

    @property
    def pending(self) -> bool:
        """Events remain to be read (some choice unfinished, or events queued)."""
        return bool(self._replay) or bool(self._events) or not all(t.done for t in self.tracks)

    @property
    def num_completion_tokens(self) -> int:
        return sum(t.num_tokens for t in self.tracks)

    @property
    def num_cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.tracks)

    # -- fed by the service, on the event loop -----------------------------------------
    def take(self, track: Track, delta: TokenDelta) -> None:
        """Add the part of `delta` the client has not seen yet, in order: a delta that
        starts past what the client has waits for the one before it."""
        if _ahead(track, delta) and len(track.held) < MAX_HELD:
            if not track.held:
                track.held_since = time.monotonic()
            track.held.append(delta)
            return
        self._add(track, delta)
        self._take_held(track, force=False)

    def _take_held(self, track: Track, *, force: bool) -> None:
        """What the track held that is no longer ahead (all of it when `force`)."""
        while track.held and not track.done:
            track.held.sort(key=lambda d: (d.token_offset, d.text_offset))
            if not force and _ahead(track, track.held[0]) and len(track.held) < MAX_HELD:
                return
            self._add(track, track.held.pop(0))
        track.held.clear()

    def _release_stale_gaps(self) -> None:
        now = time.monotonic()
        for track in self.tracks:
            if track.held and now - track.held_since >= GAP_WAIT_S:
                self._take_held(track, force=True)

    def _add(self, track: Track, delta: TokenDelta) -> None:
        if _ahead(track, delta):
            logger.warning(
                "gap in deltas request_id=%s attempt=%s: have %s tokens, delta starts at %s",
                track.request_id,
                delta.attempt,
                track.num_tokens,
                delta.token_offset,
            )
        if track.done:
            return
        skip_tokens = max(0, track.num_tokens - delta.token_offset)
        skip_chars = max(0, track.num_chars - delta.text_offset)
        token_ids = delta.token_ids[skip_tokens:]
        logprobs = delta.logprobs[skip_tokens:] if delta.logprobs is not None else None
        text = delta.text[skip_chars:]
        track.num_tokens = max(track.num_tokens, delta.token_offset + len(delta.token_ids))
        track.num_chars = max(track.num_chars, delta.text_offset + len(delta.text))
        error = None
        if delta.finish_reason is not None:
            track.done = True
            error = _client_error(track.request_id, delta)
            if delta.usage is not None:
                track.cached_tokens = delta.usage.cached_tokens
        prompt_logprobs = None
        if delta.prompt_logprobs is not None and not track.prompt_logprobs_taken:
            track.prompt_logprobs_taken = True
            prompt_logprobs = delta.prompt_logprobs
        if token_ids or text or delta.finish_reason is not None or prompt_logprobs:
            self._put(
                StreamEvent(
                    index=track.index,
                    text=text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    error=error,
                    error_code=delta.error_code,
                    prompt_logprobs=prompt_logprobs,
                )
            )

    # -- read by the route ---------------------------------------------------------------
    def keep_log(self) -> None:
        """Keep the events read from now on (a resumable stream, before its first read)."""
        self._log = []

    def drop_log(self) -> None:
        """No reader will come back: let the events read so far go now, not whenever the
        cycle collector reaches the stream's generators."""
        self._log = None
        self._replay.clear()

    def rewind(self) -> None:
        """A new reader takes over: the events read so far come again, then the rest."""
        assert self._log is not None, "rewind needs keep_log"
        self._replay = deque(self._log)
        self._log = []
        self.read_tokens = [0] * len(self.tracks)
        self.read_finished = [False] * len(self.tracks)

    async def next_event(self, max_wait_s: float) -> StreamEvent | None:
        """The next event; None when `max_wait_s` passed quietly (time for a keep-alive)."""
        kept = self._replay.popleft() if self._replay else None
        if kept is not None:
            event: StreamEvent | None = kept.unpack()
        else:
            event = await self._next_live(max_wait_s)
        if event is not None:
            self.read_tokens[event.index] += len(event.token_ids)
            self.read_finished[event.index] |= event.finish_reason is not None
            if self._log is not None:
                self._log.append(kept if kept is not None else _Kept.of(event))
            last = event.finish_reason is not None and not self.pending
            if last and self._timer is not None:  # no more waits: let it go now
                self._timer.cancel()
                self._timer = None
        return event

    async def _next_live(self, max_wait_s: float) -> StreamEvent | None:
        """The next event from the bus; None when `max_wait_s` passed quietly.

        Past the deadline (plus grace) the unfinished choices are cancelled on the bus
        and end with finish_reason "deadline".
        """
        if self._events:
            return self._events.popleft()
        timeout = max_wait_s
        now = time.monotonic()
        if self.wait_until is not None:
            timeout = min(timeout, max(0.0, self.wait_until - now))
        gaps = [t.held_since + GAP_WAIT_S for t in self.tracks if t.held]
        if gaps:
            timeout = min(timeout, max(0.0, min(gaps) - now))
        if timeout > 0:
            await self._wait(timeout)
            if self._events:
                return self._events.popleft()
        self._release_stale_gaps()
        if self._events:
            return self._events.popleft()
        if self.wait_until is None or time.monotonic() < self.wait_until:
            return None
        self.end("deadline", "deadline")
        return self._events.popleft()

    async def _wait(self, timeout_s: float) -> None:
        """Until an event is put or `timeout_s` passed. A bare future, not
        asyncio.wait_for: on 3.11 that returns the result instead of raising when the
        caller is cancelled as the event arrives; here the cancel is raised and the
        event stays queued."""
        loop = asyncio.get_running_loop()
        self._due = loop.time() + timeout_s
        if self._timer is None or self._timer.when() > self._due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._due, self._on_timer)
        waiter = self._waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        """Wake the waiting reader once its wait is over; a wait that began since the
        timer was armed ends later: the timer moves on to it."""
        self._timer = None
        waiter = self._waiter
        if waiter is None:
            return
        loop = waiter.get_loop()
        if loop.time() >= self._due - _TIMER_SLACK_S:
            _wake(waiter)
        else:
            self._timer = loop.call_at(self._due, self._on_timer)

    def _put(self, event: StreamEvent) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None:
            _wake(waiter)

    def end(self, finish: FinishReason, cancel_reason: str, error: str | None = None) -> None:
        """Cancel the unfinished choices on the bus and end them here with `finish`."""
        unfinished = [t for t in self.tracks if not t.done]
        self._service.cancel(self, reason=cancel_reason)
        for track in unfinished:
            self._put(StreamEvent(track.index, finish_reason=finish, error=error))

    def abandon(self, reason: str = "client disconnected") -> None:
        """The caller went away: cancel whatever is still running."""
        if any(not t.done for t in self.tracks):
            self._service.cancel(self, reason=reason)

    async def collect(self) -> list[ChoiceResult]:
        """Wait for every choice to finish (non-streaming answers)."""
        results = [ChoiceResult(index=t.index) for t in self.tracks]
        while self.pending:
            event = await self.next_event(3600.0)
            if event is not None:
                _add(results[event.index], event)
        return results

    def results(self) -> list[ChoiceResult]:
        """Every choice as taken so far, without waiting (a finished generation's answer)."""
        results = [ChoiceResult(index=t.index) for t in self.tracks]
        while self._events:
            event = self._events.popleft()
            _add(results[event.index], event)
        return results


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _add(result: ChoiceResult, event: StreamEvent) -> None:
    result.text += event.text
    result.token_ids.extend(event.token_ids)
    if event.logprobs:
        result.logprobs.extend(event.logprobs)
    if event.prompt_logprobs is not None:
        result.prompt_logprobs = event.prompt_logprobs
    if event.finish_reason is not None:
        result.finish_reason, result.error = event.finish_reason, event.error
        result.error_code = event.error_code


def _ahead(track: Track, delta: TokenDelta) -> bool:
    """The delta starts past what the client has: one before it is still on its way."""
    return delta.token_offset > track.num_tokens or delta.text_offset > track.num_chars
