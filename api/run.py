"""Run one chat or completions call and answer it: an SSE stream of chunks, or one JSON body.

What the two routes share lives here: building the call (off the loop when it compiles
a constraint or is large), submitting it, and the frame of either answer. A stream
opens with the route's first chunks and pings while idle; an event whose finish is an
error ends it with that error's body and `[DONE]`, else it closes with the usage chunk
(when `stream_options.include_usage`) and `[DONE]`. Every stream event carries an id; a
stream whose connection ended is parked for its resume window, and the same request
asked again with `Last-Event-ID` resumes after that event (`api/resume.py`), on this
gateway or, with a shared directory of streams, on another one: the call is then built
again with its id and its deltas followed where they go (`GatewayService.adopt`). A whole
answer waits for every choice (499 when the client left first) and carries the usage. A
route says the rest in a `CallAnswer`: how an event becomes chunks and how the whole
body reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from sluice.api.auth import Principal
from sluice.api.deps import Gateway, build_off_loop_if_large, call_id, gateway, screened_principal
from sluice.api.errors import InvalidRequest, error_for_finish
from sluice.api.formatting import generation_usage
from sluice.api.generation import ChoiceResult, Generation, StreamEvent
from sluice.api.prepare import Call
from sluice.api.resume import (
    EventId,
    EventIds,
    ResumableStream,
    ResumableStreams,
    check_choices,
    request_digest,
)
from sluice.api.schemas import StreamOptions
from sluice.api.served import ServedModel
from sluice.api.streaming import (
    DONE,
    PING,
    SEND_STALLED,
    SSEResponse,
    collect_answer,
    pump,
    sse_data,
)
from sluice.storage.streams import StreamRecord

Payload = dict[str, Any]
BodyT = TypeVar("BodyT")
Events = Callable[[], AsyncIterator[str]]
# a stream another gateway ran, rebuilt here from its record: its generation and events
Adopt = Callable[[StreamRecord], Awaitable[tuple[Generation, Events]]]


class StreamedBody(Protocol):
    """The request fields that choose between a stream and a whole answer."""

    stream: bool
    stream_options: StreamOptions | None


class CallAnswer(ABC):
    """One call's answer as its route lays it out; made before the call is submitted."""

    def __init__(self, body: StreamedBody, call: Call, model: ServedModel) -> None:
        self.call = call
        self.model = model
        self.stream = body.stream
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    @abstractmethod
    def begin(self, generation: Generation) -> None:
        """The call was submitted: `generation` runs it."""

    def opening(self) -> Iterator[Payload]:
        """The stream's first chunks, before any event."""
        return iter(())

    @abstractmethod
    def before_finish(self, ev: StreamEvent) -> Iterator[Payload]:
        """Chunks for `ev` that go out before its finish is checked for an error."""

    def after_finish(self, ev: StreamEvent) -> Iterator[Payload]:
        """Chunks for `ev` once its finish (if any) was no error."""
        return iter(())

    def usage(self, generation: Generation) -> Payload:
        """The usage object of the whole answer and of the stream's usage chunk."""
        return generation_usage(self.call.num_prompt_tokens, generation)

    @abstractmethod
    def usage_chunk(self, generation: Generation) -> Payload:
        """The stream's include_usage chunk."""

    @abstractmethod
    def whole(self, results: list[ChoiceResult], usage_obj: Payload) -> Payload:
        """The non-streamed answer."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a call: the HTTP request, its screened principal, and the gateway."""

    request: Request
    principal: Principal
    gw: Gateway


def caller(
    request: Request,
    principal: Principal = Depends(screened_principal),
    gw: Gateway = Depends(gateway),
) -> Caller:
    """A generation route's dependency: screened before its body is validated."""
    return Caller(request, principal, gw)


async def run_call(
    who: Caller,
    body: BodyT,
    build: Callable[[BodyT, Any, Principal, Gateway, str], tuple[Call, ServedModel]],
    compiles: Callable[[BodyT], bool],
    answer: Callable[[BodyT, Call, ServedModel], CallAnswer],
) -> Response:
    """Build the call for `body` (off the loop where `compiles`), submit it, answer it.
    A stream asked again with `Last-Event-ID` resumes where the client left it."""
    request, principal, gw = who.request, who.principal, who.gw

    async def built(cid: str) -> tuple[Call, ServedModel]:
        return await build_off_loop_if_large(
            request, lambda: build(body, request.headers, principal, gw, cid), compiles(body)
        )

    def events_of(generation: Generation, call: Call, model: ServedModel) -> Events:
        def events() -> AsyncIterator[str]:  # from the first event, for each reader
            fresh = answer(body, call, model)
            fresh.begin(generation)
            return _events(generation, fresh, gw.sse_ping_s)

        return events

    async def adopt(record: StreamRecord) -> tuple[Generation, Events]:
        call, model = await built(record.call_id)
        generation = gw.service.adopt(
            record.reply_to, call.requests, record.deadline_ms, record.created_s
        )
        return generation, events_of(generation, call, model)

    resumed = await resumed_stream(request, principal, body, gw, adopt)
    if resumed is not None:
        return resumed
    call, model = await built(call_id(request))
    out = answer(body, call, model)
    generation = await gw.submit(request, principal, call.requests, call.deadline_ms)
    out.begin(generation)
    if out.stream:
        events = events_of(generation, call, model)
        cid = call.call_id
        return resumable_stream(
            request, principal, body, cid, generation, gw, events, call.deadline_ms, shared=True
        )
    results = await collect_answer(request, generation)
    if results is None:
        return Response(status_code=499)
    return JSONResponse(out.whole(results, out.usage(generation)))


def resumable_stream(
    request: Request,
    principal: Principal,
    body: Any,
    cid: str,
    generation: Generation,
    gw: Gateway,
    events: Events,
    deadline_ms: int | None = None,
    *,
    shared: bool = False,
) -> SSEResponse:
    """The SSE answer of a stream a client may resume: `events()` gives its SSE events
    (PING while idle) from the generation's first, through a fresh formatter each time.
    `shared`: it goes in the deployment's directory, for another gateway to take over
    (its route passes `resumed_stream` an `adopt`)."""
    key = stream_key(request, body)
    streams, tenant_id = gw.service.streams, principal.tenant_id
    record = None
    if shared:
        gateway_id = gw.service.gateway_id
        digest = request_digest(key)
        record = StreamRecord(
            cid, tenant_id, digest, gateway_id, gateway_id, deadline_ms, generation.created
        )
    stream = streams.open(cid, tenant_id, key, generation, events, record)
    return SSEResponse(_stream(request, streams, stream, None))


async def resumed_stream(
    request: Request, principal: Principal, body: Any, gw: Gateway, adopt: Adopt | None = None
) -> SSEResponse | None:
    """The rest of the stream a streaming request's `Last-Event-ID` names; None without
    one. A stream this gateway does not hold is looked up in the directory and taken
    over with `adopt` where one is given. 404 when that stream is gone (ended, its
    window passed, another gateway's without a directory)."""
    last_event_id = request.headers.get("last-event-id")
    if last_event_id is None or not getattr(body, "stream", False):
        return None
    after = EventId.parse(last_event_id)
    key = stream_key(request, body)
    streams, tenant_id = gw.service.streams, principal.tenant_id
    if adopt is None or streams.directory is None or streams.has(after.call_id):
        stream = await streams.resume(after, tenant_id, key)
        return SSEResponse(_stream(request, streams, stream, after))
    record = await streams.find_elsewhere(after, tenant_id, key)
    generation, events = await adopt(record)
    stream = streams.open(record.call_id, tenant_id, key, generation, events)
    try:
        check_choices(after, generation)
    except InvalidRequest:
        streams.detach(stream)  # parked: a resume with a right id may still take it
        raise
    return SSEResponse(_stream(request, streams, stream, after))


def stream_key(request: Request, body: Any) -> tuple[str, Any]:
    """What a resume must ask again: the path and the body."""
    return request.url.path, body.model_dump()


async def _stream(
    request: Request, streams: ResumableStreams, stream: ResumableStream, after: EventId | None
) -> AsyncIterator[str]:
    """The stream's events with their ids, from after `after` when it resumes one; its
    end parks it for a resume, unless the server closed a client that stopped reading."""
    ids = EventIds(stream.call_id, stream.generation, after)
    try:
        async for event in stream.events():
            framed = event if event == PING else ids.frame(event)
            if framed is not None:
                yield framed
    finally:
        streams.detach(stream, resumable=not request.scope.get("state", {}).get(SEND_STALLED))


async def _events(generation: Generation, out: CallAnswer, ping_s: float) -> AsyncIterator[str]:
    """The stream's SSE events without ids, PING while idle; each event's chunks come
    right after it is read (`EventIds` reads the generation's counts)."""
    for payload in out.opening():
        yield sse_data(payload)
    async for ev in pump(generation, ping_s):
        if ev is None:
            yield PING
            continue
        for payload in out.before_finish(ev):
            yield sse_data(payload)
        if ev.finish_reason is not None:
            error = error_for_finish(ev.finish_reason, ev.error, ev.error_code)
            if error is not None:
                yield sse_data(error.body())
                yield DONE
                return
        for payload in out.after_finish(ev):
            yield sse_data(payload)
    if out.include_usage:
        yield sse_data(out.usage_chunk(generation))
    yield DONE
