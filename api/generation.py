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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bus.messages import FinishReason, TokenDelta, TokenLogprob

if TYPE_CHECKING:
    from api.service import GatewayService

logger = logging.getLogger(__name__)


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


@dataclass(slots=True)
class StreamEvent:
    """New output of choice `index`; `finish_reason` set on its last event."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(slots=True)
class ChoiceResult:
    """A choice accumulated for a non-streaming answer."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None


class Generation:
    def __init__(
        self,
        tracks: list[Track],
        *,
        tenant_id: str,
        wait_until: float | None,
        service: GatewayService,
    ) -> None:
        self.tracks = tracks
        self.tenant_id = tenant_id
        self.wait_until = wait_until  # time.monotonic() after which we stop waiting
        self.created = int(time.time())
        self._service = service
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

    @property
    def request_id(self) -> str:
        return self.tracks[0].request_id

    @property
    def pending(self) -> bool:
        """Events remain to be read (some choice unfinished, or events queued)."""
        return not self._queue.empty() or not all(t.done for t in self.tracks)

    @property
    def num_completion_tokens(self) -> int:
        return sum(t.num_tokens for t in self.tracks)

    @property
    def num_cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.tracks)

    # -- fed by the service, on the event loop -----------------------------------------
    def take(self, track: Track, delta: TokenDelta) -> None:
        """Add the part of `delta` the client has not seen yet."""
        if delta.token_offset > track.num_tokens or delta.text_offset > track.num_chars:
            logger.warning(
                "gap in deltas request_id=%s attempt=%s: have %s tokens, delta starts at %s",
                track.request_id,
                delta.attempt,
                track.num_tokens,
                delta.token_offset,
            )
        skip_tokens = max(0, track.num_tokens - delta.token_offset)
        skip_chars = max(0, track.num_chars - delta.text_offset)
        token_ids = delta.token_ids[skip_tokens:]
        logprobs = delta.logprobs[skip_tokens:] if delta.logprobs is not None else None
        text = delta.text[skip_chars:]
        track.num_tokens = max(track.num_tokens, delta.token_offset + len(delta.token_ids))
        track.num_chars = max(track.num_chars, delta.text_offset + len(delta.text))
        if delta.finish_reason is not None:
            track.done = True
            if delta.usage is not None:
                track.cached_tokens = delta.usage.cached_tokens
        if token_ids or text or delta.finish_reason is not None:
            self._queue.put_nowait(
                StreamEvent(
                    index=track.index,
                    text=text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    error=delta.error,
                )
            )

    # -- read by the route ---------------------------------------------------------------
    async def next_event(self, max_wait_s: float) -> StreamEvent | None:
        """The next event; None when `max_wait_s` passed quietly (time for a keep-alive).

        Past the deadline (plus grace) the unfinished choices are cancelled on the bus
        and end with finish_reason "deadline".
        """
        timeout = max_wait_s
        if self.wait_until is not None:
            timeout = min(timeout, max(0.0, self.wait_until - time.monotonic()))
        try:
            # not asyncio.wait_for: on 3.11 it returns the result instead of raising when
            # the caller is cancelled as the event arrives, and the cancelled stream then
            # waited for the next event (up to max_wait_s): seen as 120 s stalls in
            # `bench serving`'s fairness run while it cancelled 500 streams
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            if self.wait_until is None or time.monotonic() < self.wait_until:
                return None
        self.end("deadline", "deadline")
        return self._queue.get_nowait()

    def end(self, finish: FinishReason, cancel_reason: str, error: str | None = None) -> None:
        """Cancel the unfinished choices on the bus and end them here with `finish`."""
        unfinished = [t for t in self.tracks if not t.done]
        self._service.cancel(self, reason=cancel_reason)
        for track in unfinished:
            self._queue.put_nowait(StreamEvent(track.index, finish_reason=finish, error=error))

    def abandon(self, reason: str = "client disconnected") -> None:
        """The caller went away: cancel whatever is still running."""
        if any(not t.done for t in self.tracks):
            self._service.cancel(self, reason=reason)

    async def collect(self) -> list[ChoiceResult]:
        """Wait for every choice to finish (non-streaming answers)."""
        results = [ChoiceResult(index=t.index) for t in self.tracks]
        while self.pending:
            event = await self.next_event(3600.0)
            if event is None:
                continue
            result = results[event.index]
            result.text += event.text
            result.token_ids.extend(event.token_ids)
            if event.logprobs:
                result.logprobs.extend(event.logprobs)
            if event.finish_reason is not None:
                result.finish_reason, result.error = event.finish_reason, event.error
        return results
