"""What the gateway last heard of the engines: whether a worker said that none is up.

On the reply path (`api.service`): a delta marked ENGINE_UNAVAILABLE (a worker waited
`engine_wait_s` for its engine, `consumers.engine_worker`) sets the verdict; a delta with
output or a normal finish clears it (an engine serves again). While the verdict stands, a
call waits a little for its first delta before its answer starts: a worker that already
knows refuses it at once, so a stream gets the plain 503 status rather than a 200 whose
stream ends in the error event. Without a verdict nothing waits. Each model pool has its
own verdict: one pool's engines being down says nothing of another's.
"""

from __future__ import annotations

import asyncio

from sluice.bus.messages import ENGINE_UNAVAILABLE, TokenDelta

# How long a call waits for its first delta while the verdict stands: a refusing worker
# answers within a poll and a publish; an engine back by now sends its first token, or
# the answer starts as usual once this passed.
HOLD_S = 2.0


class EngineVerdict:
    """The last word of the workers on this gateway's calls; used on the event loop."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self.down: dict[str, str] = {}  # pool → the worker's message while no engine is up
        self._first: dict[str, asyncio.Future[TokenDelta]] = {}

    def heard(self, delta: TokenDelta, pool: str | None) -> None:
        """Every delta routed to this gateway, with the pool of its request (None: not a
        request of this gateway's any more)."""
        if pool is not None:
            if delta.error_code == ENGINE_UNAVAILABLE:
                self.down[pool] = delta.error or "no engine is up"
            elif self.down and (delta.token_ids or delta.finish_reason in ("stop", "length")):
                self.down.pop(pool, None)
        waiter = self._first.pop(delta.request_id, None) if self._first else None
        if waiter is not None and not waiter.done():
            waiter.set_result(delta)

    def watch(self, request_id: str, pool: str) -> asyncio.Future[TokenDelta] | None:
        """Before the call is published (so its first delta is not missed): a future of
        that delta while the pool's verdict stands, else None."""
        if pool not in self.down:
            return None
        waiter: asyncio.Future[TokenDelta] = asyncio.get_running_loop().create_future()
        self._first[request_id] = waiter
        return waiter

    def forget(self, request_id: str) -> None:
        """The call is done with `watch` (refused, published, or failed to publish)."""
        self._first.pop(request_id, None)

    async def refusal(self, request_id: str, waiter: asyncio.Future[TokenDelta]) -> str | None:
        """The worker's message when the call's first delta, awaited at most `hold_s`,
        says no engine is up; None when it says otherwise or does not come in time."""
        try:
            async with asyncio.timeout(self.hold_s):
                delta = await waiter
        except TimeoutError:
            return None
        finally:
            self._first.pop(request_id, None)
        if delta.error_code != ENGINE_UNAVAILABLE:
            return None
        return delta.error or "no engine is up"
