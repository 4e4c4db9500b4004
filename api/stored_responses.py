"""`ResponseKeeper`: stored and background responses of the Responses API, per gateway.

Sits between the `/v1/responses` routes and the response store (`storage.responses`):

- `store` (default true, as OpenAI's): a finished response is kept with its input, so
  `GET /v1/responses/{id}`, its input items and `previous_response_id` read it back.
- `background`: the response runs as a task of the gateway that took it, which writes
  its events to the store as they come (a few at a time) and holds a lease on its row.
  `follow` replays the stored events after N and follows live: from this gateway's
  memory when it runs the response here, else by polling the store, so any gateway
  serves any stored response.
- A streamed stored response (`stream`, `store`) runs the same way, and the POST's SSE
  body follows it from the first event; each event's SSE `id:` is
  `<response id>:<sequence_number>`. The same request asked again with `Last-Event-ID`
  follows from after that event on the gateway that runs it (`resume_streamed`);
  nothing is published again. A run with no follower left is cancelled once
  `window_s` passed without one coming back, billed for what ran, stored `cancelled`.
- A gateway that died leaves its running responses leased to nobody: every gateway's
  sweep fails those whose lease lapsed (status "failed", a clear error, a last
  `response.failed` event), so a restart never leaves one `in_progress` forever. They
  are not run again: the tokens already streamed to a follower were billed, and a rerun
  would bill and show a different answer. The sweep also deletes responses past the
  retention.
- Cancel: on this gateway the engine's Cancel goes out at once
  (`GatewayService.cancel_and_follow`); the engine's terminal delta then ends the
  response with the usage the engine bills. For a response another gateway runs, the
  request is marked in the store and that gateway's sweep acts on it.

Store calls are synchronous (SQL), so they run in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from sluice.api.errors import APIError, InvalidRequest, NotFound
from sluice.api.generation import Generation
from sluice.api.responses_format import ResponsesFormat
from sluice.api.resume import not_resumable
from sluice.api.service import GatewayService
from sluice.storage.responses import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

LEASE_S = 15  # a running response's lease; renewed every SWEEP_S
SWEEP_S = 5.0
FLUSH_S = 0.1  # events are written at most this long after they were sent
POLL_S = 0.25  # a follower of a response run by another gateway reads the store this often
CANCEL_WAIT_S = 10.0  # how long a cancel waits for the response to end
TERMINAL = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)
STOP_WAIT_S = 5.0  # how long a stopping gateway waits for its responses' last writes
# a streamed response whose first follower never began reading (its client left before
# the body started) is parked as one whose client left, after at least this long
FIRST_READ_S = 10.0
SHUT_DOWN = "the server shut down before this background response finished; create it again"
ORPHANED = {
    "code": "server_error",
    "message": "the server running this background response stopped before it finished;"
    " create the response again",
}


def not_found(response_id: str) -> NotFound:
    return NotFound(f"No response found with id '{response_id}'.", param="response_id")


class _Run:
    """A background (or streamed stored) response running on this gateway: its events so
    far, for followers."""

    def __init__(self, response_id: str, generation: Generation) -> None:
        self.response_id = response_id
        self.generation = generation
        # a streamed one: who may resume it, and its followers now
        self.tenant_id = ""
        self.request_key: Any = None
        self.followers = 0
        self.expiry: asyncio.TimerHandle | None = None
        self.events: list[dict[str, Any]] = []
        self.cancel_requested = False
        self.ended = asyncio.Event()
        self._changed = asyncio.Event()

    def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended.set()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


class ResponseKeeper:
    def __init__(self, store: ResponseStore, service: GatewayService, retention_s: int) -> None:
        self.store = store
        self.service = service
        self.retention_s = retention_s
        self._runs: dict[str, _Run] = {}
        self._streamed: dict[str, _Run] = {}  # resumable: until a window after the last follower
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        """Stop sweeping and fail the responses still running here (nothing resumes them
        once this gateway is gone), waiting a little for their last writes; one whose
        write does not make it is failed by a later sweep once its lease lapses."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for run in list(self._runs.values()):
            run.generation.end("error", "gateway shutting down", SHUT_DOWN)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=STOP_WAIT_S)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # a database outage: the next sweep tries again
                logger.exception("response sweep failed")
            await asyncio.sleep(SWEEP_S)

    async def sweep(self) -> None:
        """Renew this gateway's leases (acting on cancels asked elsewhere), fail the
        responses whose gateway died, delete those past the retention."""
        store, owner = self.store, self.service.gateway_id
        cancelled = await asyncio.to_thread(store.renew, owner, list(self._runs), LEASE_S)
        for response_id in cancelled:
            self._cancel_local(response_id)
        failed = await asyncio.to_thread(store.fail_orphans, ORPHANED)
        for response_id in failed:
            logger.warning("background response %s failed: its gateway stopped", response_id)
        await asyncio.to_thread(store.delete_expired, self.retention_s)

    # -- creating -------------------------------------------------------------------
    async def get(self, response_id: str, tenant_id: str) -> StoredResponse:
        stored = await asyncio.to_thread(self.store.get, response_id, tenant_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    async def previous_items(self, response_id: str, tenant_id: str) -> list[dict[str, Any]]:
        """What a response continuing `response_id` runs on before its own input: that
        response's input items and its output."""
        previous = await self.get(response_id, tenant_id)
        if not previous.finished:
            raise InvalidRequest(
                f"Previous response with id '{response_id}' is still {previous.status}; wait"
                " for it to finish.",
                param="previous_response_id",
            )
        return [*previous.input_items, *previous.body.get("output", [])]

    async def keep(
        self, response: dict[str, Any], tenant_id: str, items: list[dict[str, Any]]
    ) -> None:
        """Store a finished (not background) response."""
        await asyncio.to_thread(self.store.create, response, tenant_id, items, background=False)

    async def run_background(
        self,
        fmt: ResponsesFormat,
        generation: Generation,
        tenant_id: str,
        items: list[dict[str, Any]],
        ping_s: float,
    ) -> dict[str, Any]:
        """Store the queued response and run it as a task; the queued object."""
        queued = fmt.response("queued")
        owner = self.service.gateway_id
        try:
            await asyncio.to_thread(
                self.store.create, queued, tenant_id, items, background=True,
                owner=owner, lease_s=LEASE_S,
            )  # fmt: skip
        except BaseException:
            generation.abandon("response not stored")
            raise
        self._start(_Run(fmt.id, generation), fmt, ping_s)
        return queued

    def _start(self, run: _Run, fmt: ResponsesFormat, ping_s: float) -> None:
        self._runs[run.response_id] = run
        task = asyncio.create_task(self._run(run, fmt, ping_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run_streamed(
        self,
        fmt: ResponsesFormat,
        generation: Generation,
        tenant_id: str,
        items: list[dict[str, Any]],
        ping_s: float,
        request_key: Any,
        window_s: float,
    ) -> AsyncIterator[dict[str, Any]]:
        """Store the in-progress response, run it as a task; its events for the POST that
        created it (see the module docstring)."""
        owner = self.service.gateway_id
        try:
            await asyncio.to_thread(
                self.store.create, fmt.response("in_progress"), tenant_id, items,
                background=False, owner=owner, lease_s=LEASE_S,
            )  # fmt: skip
        except BaseException:
            generation.abandon("response not stored")
            raise
        run = _Run(fmt.id, generation)
        run.tenant_id, run.request_key = tenant_id, request_key
        self._streamed[fmt.id] = run
        self._start(run, fmt, ping_s)
        run.expiry = asyncio.get_running_loop().call_later(
            max(window_s, FIRST_READ_S), self._expire, run
        )
        return self._attached(run, -1, window_s)

    def resume_streamed(
        self, response_id: str, after: int, tenant_id: str, request_key: Any, window_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The events after `after` of a streamed response this gateway runs (or ran
        within the window), then the live rest. 404 for one it does not hold or another
        tenant's; 400 for another request."""
        run = self._streamed.get(response_id)
        if run is None or run.tenant_id != tenant_id:
            raise not_resumable(f"{response_id}:{after}")
        if run.request_key != request_key:
            raise InvalidRequest(
                "Last-Event-ID belongs to a stream of another request; send the same request"
                " again to resume it",
                param="Last-Event-ID",
                code="invalid_value",
            )
        return self._attached(run, after, window_s)

    async def _attached(
        self, run: _Run, after: int, window_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        run.followers += 1
        if run.expiry is not None:
            run.expiry.cancel()
            run.expiry = None
        try:
            async for event in self._follow(run.response_id, run.tenant_id, after):
                yield event
        finally:
            run.followers -= 1
            if run.followers == 0:
                # parked even when every event went out: sent is not received
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # finalized with no loop left (shutdown): no one resumes
                    self._streamed.pop(run.response_id, None)
                else:
                    run.expiry = loop.call_later(max(window_s, 0), self._expire, run)

    def _expire(self, run: _Run) -> None:
        """No follower came back within the window: cancelled if it still runs (billed
        for what ran), and no longer resumable."""
        run.expiry = None
        if run.followers:
            return
        if self._streamed.get(run.response_id) is run:
            del self._streamed[run.response_id]
        if not run.ended.is_set():
            logger.info("streamed response %s not resumed: cancelled", run.response_id)
            self._cancel_local(run.response_id)

    async def _run(self, run: _Run, fmt: ResponsesFormat, ping_s: float) -> None:
        pending: list[dict[str, Any]] = []
        flushed_at = time.monotonic()
        final: dict[str, Any] | None = None
        last: dict[str, Any] | None = None  # goes out once stored, so a GET then reads it
        try:
            events = fmt.events(run.generation, ping_s, lambda: run.cancel_requested)
            async for event in events:
                body = None
                if event is not None:
                    pending.append(event)
                    if event["type"] in TERMINAL:
                        final, last = event["response"], event
                    else:
                        run.add(event)
                    if event["type"] == "response.in_progress":
                        body = event["response"]
                due = time.monotonic() - flushed_at >= FLUSH_S
                if pending and (body is not None or final is not None or due):
                    await asyncio.to_thread(
                        self.store.write, fmt.id, final or body, pending, finished=final is not None
                    )
                    pending, flushed_at = [], time.monotonic()
        except Exception as exc:
            logger.exception("background response %s failed", fmt.id)
            if final is None:
                error = exc if isinstance(exc, APIError) else APIError("the response failed")
                last = fmt.event("response.failed", response=fmt.response("failed", error=error))
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(
                        self.store.write, fmt.id, last["response"], [*pending, last],
                        finished=True,
                    )  # fmt: skip
        finally:
            if last is not None:
                run.add(last)
            run.generation.abandon("background response ended")
            self._runs.pop(fmt.id, None)
            run.end()

    # -- reading ----------------------------------------------------------------------
    async def follow(
        self, response_id: str, tenant_id: str, after: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The response's stream events numbered above `after`, then the live ones until
        its end. Raises NotFound, or InvalidRequest for a response not run in background."""
        stored = await self.get(response_id, tenant_id)
        if not stored.background:
            raise InvalidRequest(
                "This response cannot be streamed because it was not created with background=true.",
                param="stream",
            )
        return self._follow(response_id, tenant_id, after)

    async def _follow(
        self, response_id: str, tenant_id: str, after: int
    ) -> AsyncIterator[dict[str, Any]]:
        run = self._runs.get(response_id)
        if run is not None:  # here every event since the first is in memory, by number
            while True:
                if len(run.events) > after + 1:
                    event = run.events[after + 1]
                    yield event
                    after = event["sequence_number"]
                    if event["type"] in TERMINAL:
                        return
                elif run.ended.is_set():
                    break
                else:
                    await run.changed()  # no await since the check: no wake-up is missed
        while True:  # run elsewhere, or ended here meanwhile: the store has every event
            events = await asyncio.to_thread(self.store.events_after, response_id, tenant_id, after)
            for event in events:
                yield event
                after = event["sequence_number"]
                if event["type"] in TERMINAL:
                    return
            if not events:
                stored = await asyncio.to_thread(self.store.get, response_id, tenant_id)
                if stored is None:  # deleted meanwhile
                    return
                await asyncio.sleep(POLL_S)

    # -- cancelling and deleting ------------------------------------------------------
    async def cancel(self, response_id: str, tenant_id: str) -> dict[str, Any]:
        """Cancel a background response; the response object once it ended (or as it is
        when it takes longer than CANCEL_WAIT_S)."""
        stored = await asyncio.to_thread(self.store.request_cancel, response_id, tenant_id)
        if stored is None:
            raise not_found(response_id)
        if not stored.background:
            raise InvalidRequest(
                "Only responses created with background=true can be cancelled.",
                param="response_id",
            )
        if stored.finished:
            raise InvalidRequest(
                f"Cannot cancel a response with status '{stored.status}'.",
                param="response_id",
                code="invalid_state",
            )
        run = self._cancel_local(response_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        if run is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.ended.wait(), CANCEL_WAIT_S)
        while time.monotonic() < deadline:  # another gateway acts on it at its next sweep
            stored = await self.get(response_id, tenant_id)
            if stored.finished:
                break
            await asyncio.sleep(POLL_S)
        return stored.body

    def _cancel_local(self, response_id: str) -> _Run | None:
        run = self._runs.get(response_id)
        if run is not None and not run.cancel_requested:
            run.cancel_requested = True
            self.service.cancel_and_follow(run.generation, "response cancelled")
        return run

    async def delete(self, response_id: str, tenant_id: str) -> None:
        """Delete a stored response; one still running here is cancelled first."""
        await self.get(response_id, tenant_id)
        run = self._runs.get(response_id)
        if run is not None:
            self._cancel_local(response_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.ended.wait(), CANCEL_WAIT_S)
        if not await asyncio.to_thread(self.store.delete, response_id, tenant_id):
            raise not_found(response_id)
