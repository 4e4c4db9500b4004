"""`api/resume.py`: event ids, and the parked streams a client may resume."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from sluice.api import resume
from sluice.api.errors import Conflict, InvalidRequest, NotFound
from sluice.api.generation import Generation, StreamEvent, Track
from sluice.api.resume import EventId, EventIds, ResumableStreams
from sluice.bus.messages import TokenLogprob, TopLogprob
from sluice.storage.streams import MemoryStreamDirectory, StreamRecord


def on_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (the suite has no async plugin)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


class Canceller:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, generation: Generation, reason: str = "client disconnected") -> None:
        for track in generation.tracks:
            if not track.done:
                track.done = True
                self.cancelled.append(track.request_id)


def _generation(canceller: Canceller, n: int = 1) -> Generation:
    tracks = [Track(index=i, request_id=f"req_abc-{i}") for i in range(n)]
    return Generation(tracks, tenant_id="t1", wait_until=None, service=canceller)


async def _no_events() -> AsyncIterator[str]:
    return
    yield  # an async generator


def test_an_event_id_reads_back_as_written() -> None:
    event_id = EventId("abc", (12, 0), (True, False), 3)
    assert str(event_id) == "abc:12f,0:3"
    assert EventId.parse(str(event_id)) == event_id


@pytest.mark.parametrize("raw", ["", "abc", "abc:1:0", "abc:x:1", ":1:1", "abc:-1:1", "a:1:1:1"])
def test_a_malformed_event_id_is_a_400_naming_the_header(raw: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        EventId.parse(raw)
    assert info.value.param == "Last-Event-ID"


def test_ids_change_with_the_tokens_read_and_count_events_between() -> None:
    generation = _generation(Canceller())
    ids = EventIds("abc", generation, None)
    assert ids.frame("data: a\n\n") == "id: abc:0:1\ndata: a\n\n"
    generation.read_tokens[0] = 2
    assert ids.frame("data: b\n\n") == "id: abc:2:1\ndata: b\n\n"
    assert ids.frame("data: c\n\n") == "id: abc:2:2\ndata: c\n\n"
    generation.read_finished[0] = True
    assert ids.frame("data: d\n\n") == "id: abc:2f:1\ndata: d\n\n"


def test_a_replay_sends_only_what_follows_the_last_event_id() -> None:
    generation = _generation(Canceller())
    ids = EventIds("abc", generation, EventId.parse("abc:2:2"))
    assert ids.frame("data: a\n\n") is None
    generation.read_tokens[0] = 2
    assert ids.frame("data: b\n\n") is None
    assert ids.frame("data: c\n\n") is None  # the client's last event
    assert ids.frame("data: d\n\n") == "id: abc:2:3\ndata: d\n\n"


@on_loop
async def test_a_stream_resumes_for_its_tenant_and_request_only() -> None:
    streams = ResumableStreams(window_s=30.0)
    generation = _generation(Canceller())
    stream = streams.open("abc", "t1", ("/v1/x", {"a": 1}), generation, _no_events)
    streams.detach(stream)
    after = EventId.parse("abc:0:1")
    with pytest.raises(NotFound):
        await streams.resume(after, "t2", ("/v1/x", {"a": 1}))  # another tenant's
    with pytest.raises(InvalidRequest):
        await streams.resume(after, "t1", ("/v1/x", {"a": 2}))
    with pytest.raises(InvalidRequest):
        await streams.resume(EventId.parse("abc:0,0:1"), "t1", ("/v1/x", {"a": 1}))
    assert await streams.resume(after, "t1", ("/v1/x", {"a": 1})) is stream
    assert stream.attached
    with pytest.raises(NotFound):
        await streams.resume(EventId.parse("zzz:0:1"), "t1", ("/v1/x", {"a": 1}))


@on_loop
async def test_a_resume_waits_for_the_connection_it_replaces() -> None:
    streams = ResumableStreams(window_s=30.0)
    stream = streams.open("abc", "t1", "key", _generation(Canceller()), _no_events)
    resuming = asyncio.create_task(streams.resume(EventId.parse("abc:0:1"), "t1", "key"))
    await asyncio.sleep(0)
    assert not resuming.done()
    streams.detach(stream)  # the old connection is noticed as gone
    assert await resuming is stream


@on_loop
async def test_a_resume_of_a_stream_still_sent_elsewhere_is_a_409(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resume, "TAKEOVER_WAIT_S", 0.01)
    streams = ResumableStreams(window_s=30.0)
    streams.open("abc", "t1", "key", _generation(Canceller()), _no_events)
    with pytest.raises(Conflict):
        await streams.resume(EventId.parse("abc:0:1"), "t1", "key")


@on_loop
async def test_a_parked_stream_not_resumed_is_cancelled_once_its_window_passed() -> None:
    canceller = Canceller()
    streams = ResumableStreams(window_s=0.01)
    stream = streams.open("abc", "t1", "key", _generation(canceller), _no_events)
    streams.detach(stream)
    assert not canceller.cancelled  # it runs on for the window
    assert stream.expiry is not None
    stream.expiry._run()  # the window passed
    assert canceller.cancelled == ["req_abc-0"]
    assert len(streams) == 0


@on_loop
async def test_with_no_window_a_disconnect_cancels_at_once() -> None:
    canceller = Canceller()
    streams = ResumableStreams(window_s=0.0)
    stream = streams.open("abc", "t1", "key", _generation(canceller), _no_events)
    assert stream.generation._log is None  # nothing resumes it: its events are not kept
    streams.detach(stream)
    assert canceller.cancelled == ["req_abc-0"]
    assert len(streams) == 0


@on_loop
async def test_a_rewound_generation_reads_its_events_again_then_the_live_ones() -> None:
    generation = _generation(Canceller())
    generation.keep_log()
    track = generation.tracks[0]
    generation._put(StreamEvent(0, "ab", [1, 2]))
    first = await generation.next_event(1.0)
    assert first is not None and generation.read_tokens == [2]
    generation.rewind()
    assert generation.read_tokens == [0]
    generation._put(StreamEvent(0, "c", [3], finish_reason="stop"))
    track.done = True
    again = await generation.next_event(1.0)
    live = await generation.next_event(1.0)
    assert again is first
    assert live is not None and live.text == "c"
    assert generation.read_tokens == [3] and generation.read_finished == [True]
    assert not generation.pending


@on_loop
async def test_a_rewound_generation_reads_its_logprobs_again_as_they_were() -> None:
    generation = _generation(Canceller())
    generation.keep_log()
    top = [TopLogprob(token_id=t, logprob=-0.1 * t - 1 / 3) for t in range(20)]
    logprobs = [TokenLogprob(token_id=7, logprob=-0.123456789012345, top=top)]
    generation._put(StreamEvent(0, "a", [7], logprobs=logprobs))
    first = await generation.next_event(1.0)
    for _ in range(2):  # a second reader takes over from the first that took over
        generation.rewind()
        again = await generation.next_event(1.0)
        assert again == first
        assert again is not None and again.logprobs == logprobs


def _record(owner: str = "gw-a") -> StreamRecord:
    digest = resume.request_digest(("/v1/x", {"a": 1}))
    return StreamRecord("abc", "t1", digest, reply_to="gw-a", owner=owner)


@on_loop
async def test_a_stream_another_gateway_ran_is_claimed_for_its_tenant_and_request_only() -> None:
    directory = MemoryStreamDirectory()
    directory.put(_record())
    streams = ResumableStreams(window_s=30.0, gateway_id="gw-b", directory=directory)
    after = EventId.parse("abc:3:1")
    with pytest.raises(NotFound):
        await streams.find_elsewhere(after, "t2", ("/v1/x", {"a": 1}))  # another tenant's
    with pytest.raises(InvalidRequest):
        await streams.find_elsewhere(after, "t1", ("/v1/x", {"a": 2}))
    with pytest.raises(NotFound):
        await streams.find_elsewhere(EventId.parse("zzz:0:1"), "t1", ("/v1/x", {"a": 1}))
    assert await streams.find_elsewhere(after, "t1", ("/v1/x", {"a": 1})) == _record()
    assert directory.get("abc") == _record(owner="gw-b")
    with pytest.raises(NotFound):  # its own now: one it no longer holds has ended
        await streams.find_elsewhere(after, "t1", ("/v1/x", {"a": 1}))


@on_loop
async def test_a_parked_stream_another_gateway_claimed_runs_on_past_the_window() -> None:
    directory = MemoryStreamDirectory()
    canceller = Canceller()
    streams = ResumableStreams(window_s=0.01, gateway_id="gw-a", directory=directory)
    stream = streams.open("abc", "t1", "key", _generation(canceller), _no_events, _record())
    await _settled(streams)
    assert directory.claim(_record(), "gw-b")
    streams.detach(stream)
    assert stream.expiry is not None
    stream.expiry._run()  # the window passed
    await _settled(streams)
    assert not canceller.cancelled  # gw-b serves it
    assert len(streams) == 0
    assert directory.get("abc") == _record(owner="gw-b")


@on_loop
async def test_a_parked_stream_nobody_claimed_is_cancelled_and_dropped() -> None:
    directory = MemoryStreamDirectory()
    canceller = Canceller()
    streams = ResumableStreams(window_s=0.01, gateway_id="gw-a", directory=directory)
    stream = streams.open("abc", "t1", "key", _generation(canceller), _no_events, _record())
    await _settled(streams)
    assert directory.get("abc") == _record()
    streams.detach(stream)
    assert stream.expiry is not None
    stream.expiry._run()
    await _settled(streams)
    assert canceller.cancelled == ["req_abc-0"]
    assert directory.get("abc") is None


async def _settled(streams: ResumableStreams) -> None:
    """The directory work the streams started (writes off the loop) is done."""
    while streams._tasks:
        await asyncio.gather(*streams._tasks)


@on_loop
async def test_a_stream_resumed_on_its_first_gateway_again_is_claimed_back() -> None:
    directory = MemoryStreamDirectory()
    streams = ResumableStreams(window_s=30.0, gateway_id="gw-a", directory=directory)
    key = ("/v1/x", {"a": 1})
    stream = streams.open("abc", "t1", key, _generation(Canceller()), _no_events, _record())
    await _settled(streams)
    streams.detach(stream)
    assert directory.claim(_record(), "gw-b")  # the client went to gw-b meanwhile
    assert await streams.resume(EventId.parse("abc:0:1"), "t1", key) is stream
    assert directory.get("abc") == _record()  # gw-b leaves its copy at its window's end
