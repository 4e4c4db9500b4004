"""A gone gateway's requests stop (and stop billing); a broker outage kills no gateway."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sluice.bus.codec import encode
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import Heartbeat
from sluice.bus.topics import HEARTBEATS_TOPIC
from sluice.consumers.engine_worker import EngineWorkerConfig
from sluice.consumers.gateway_liveness import GatewayLiveness
from tests.unit.consumers.engine_harness import (
    GATEWAY,
    Client,
    WorkerThread,
    create_topics,
    make_request,
)
from tests.unit.consumers.sim_engine import RecordingSimBackend


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gateway(gateway_id: str) -> Heartbeat:
    return Heartbeat(sender_id=gateway_id, role="gateway", interval_ms=1000)


def beats(live: GatewayLiveness, clock: Clock, seconds: int, *gateways: str) -> None:
    """`seconds` of heartbeats, one a second, from this worker and `gateways`."""
    for _ in range(seconds):
        clock.now += 1.0
        live.heard(live.own_beat())
        for g in gateways:
            live.heard(gateway(g))


def test_a_gateway_silent_past_its_ttl_is_gone_while_others_are_heard() -> None:
    clock = Clock()
    live = GatewayLiveness("w1", heartbeat_s=1.0, ttl_s=5.0, clock=clock)
    beats(live, clock, 10, "gw-a", "gw-b")
    assert live.gone() == set()
    beats(live, clock, 5, "gw-a")
    assert live.gone() == set()  # 5 s silent: not yet past the ttl
    beats(live, clock, 1, "gw-a")
    assert live.gone() == {"gw-b"}
    live.heard(gateway("gw-b"))  # it was alive after all
    assert live.gone() == set()


def test_a_gateway_that_parks_streams_gets_its_resume_window_past_the_ttl() -> None:
    clock = Clock()
    live = GatewayLiveness("w1", heartbeat_s=1.0, ttl_s=5.0, clock=clock)
    beats(live, clock, 10, "gw-b")
    live.heard(Heartbeat(sender_id="gw-a", role="gateway", interval_ms=1000, resume_window_ms=4000))
    beats(live, clock, 8, "gw-b")
    assert live.gone() == set()  # 8 s silent: within ttl + window
    beats(live, clock, 2, "gw-b")
    assert live.gone() == {"gw-a"}


def test_a_request_another_gateway_follows_runs_on_while_that_one_is_heard() -> None:
    clock = Clock()
    live = GatewayLiveness("w1", heartbeat_s=1.0, ttl_s=5.0, clock=clock)
    beats(live, clock, 10, "gw-a", "gw-b")
    took_over = Heartbeat(sender_id="gw-b", role="gateway", interval_ms=1000, follows=["r1"])
    live.heard(took_over)
    assert live.followed("r1")
    assert not live.followed("r2")  # another of gw-a's requests: nobody took it over
    beats(live, clock, 5, "gw-b")
    live.heard(took_over)
    beats(live, clock, 4, "gw-b")
    assert live.gone() == {"gw-a"}
    assert live.followed("r1")
    beats(live, clock, 2, "gw-b")  # gw-b stopped naming it (its stream ended)
    assert not live.followed("r1")


def test_a_gateway_beat_without_a_window_reads_as_before() -> None:
    assert "resume_window_ms" not in encode(gateway("gw-a")).decode()


def test_an_outage_silences_every_gateway_without_killing_one() -> None:
    clock = Clock()
    live = GatewayLiveness("w1", heartbeat_s=1.0, ttl_s=5.0, clock=clock)
    beats(live, clock, 10, "gw-a", "gw-b")
    clock.now += 30.0  # the broker is away: nothing is heard, the worker's own beat neither
    assert live.gone() == set()
    # back: heartbeats arrive in any order; every gateway gets a whole ttl to be heard
    beats(live, clock, 4, "gw-a")
    assert live.gone() == set()
    beats(live, clock, 2, "gw-a")
    assert live.gone() == {"gw-b"}  # heard nothing from it for a ttl since the stream came back


def test_reply_targets_that_never_beat_are_never_judged_and_ttl_0_judges_none() -> None:
    clock = Clock()
    live = GatewayLiveness("w1", heartbeat_s=1.0, ttl_s=5.0, clock=clock)
    beats(live, clock, 60)
    assert live.gone() == set()
    off = GatewayLiveness("w1", heartbeat_s=1.0, ttl_s=0.0, clock=clock)
    off.heard(gateway("gw-a"))
    clock.now += 60.0
    assert off.gone() == set() and not off.due()


@contextmanager
def beating(gateway_id: str) -> Iterator[tuple[Client, RecordingSimBackend, threading.Event]]:
    """A worker with a 0.3 s gateway ttl, and `gateway_id` beating every 0.05 s until the
    yielded event is set: (client, backend, that event)."""
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    backend = RecordingSimBackend(step_s=0.01)
    config = EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01, heartbeat_s=0.05,
                                gateway_ttl_s=0.3)  # fmt: skip
    worker = WorkerThread(bus, backend, config).start()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            bus.publish(HEARTBEATS_TOPIC, encode(gateway(gateway_id))).result(5)

    threading.Thread(target=beat, daemon=True).start()
    try:
        yield client, backend, stop
    finally:
        stop.set()
        worker.stop()


def test_the_requests_of_a_gateway_that_stops_beating_are_cancelled_and_billed_so_far() -> None:
    with beating(GATEWAY) as (client, backend, stop_beating):
        client.send(make_request("long", max_tokens=100_000))
        client.wait(lambda: len(client.view.streams.get("long", _NONE).token_ids) >= 5)
        stop_beating.set()  # the gateway dies
        client.wait(lambda: any(u.request_id == "long" for u in client.usage), 10)
    assert "long" in backend.aborts
    [usage] = [u for u in client.usage if u.request_id == "long"]
    assert usage.finish_reason == "abort"
    assert 5 <= usage.completion_tokens < 1000  # what ran until the ttl, not max_tokens


class _Stream:
    token_ids: list[int] = []


_NONE = _Stream()


def test_a_beating_gateway_never_heard_is_gone_once_heartbeats_flow_for_the_ttl() -> None:
    """A worker started after a gateway died (a pool scaling up from zero) never heard
    it: its requests that say their gateway beats are cancelled after the ttl, billed for
    what ran; those of a reply target that sends no heartbeat (batches, bulk) run on."""
    # another gateway lives: the heartbeat stream flows; GATEWAY never beats
    with beating("gw-other") as (client, backend, _):
        client.send(make_request("orphan", max_tokens=100_000, reply_beats=True))
        client.send(make_request("batch-like", max_tokens=150))
        client.wait(lambda: {"orphan", "batch-like"} <= {u.request_id for u in client.usage}, 20)
    usage = {u.request_id: u for u in client.usage}
    assert usage["orphan"].finish_reason == "abort" and "orphan" in backend.aborts
    assert usage["orphan"].completion_tokens < 1000
    assert usage["batch-like"].finish_reason == "length"
    assert usage["batch-like"].completion_tokens == 150
