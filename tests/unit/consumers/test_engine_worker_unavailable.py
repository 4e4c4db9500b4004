"""No engine comes up: the requests held for it wait `engine_wait_s`, then end with an
'error' marked unavailable (the gateway's 503) naming the cause, and so does what
arrives while it stays down; the restarts go on, and a later start serves again."""

from __future__ import annotations

from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import ENGINE_UNAVAILABLE, TokenDelta
from sluice.engine.backends.base import EngineDeadError
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request
from tests.unit.consumers.test_engine_worker_restart import RestartableFakeBackend, fast_restarts

CAUSE = "engine process failed to start: exited with code 1"


class NeverStartingBackend(RestartableFakeBackend):
    """An engine that dies at load, on its first start and on every restart."""

    def start(self) -> None:
        raise EngineDeadError(CAUSE)

    def restart(self, loop: object = None) -> None:
        raise EngineDeadError(CAUSE)


def _terminal(client: Client, request_id: str) -> TokenDelta:
    stream = client.view.streams[request_id]
    assert stream.num_terminal == 1
    return stream.deltas[-1]


def _assert_unavailable(delta: TokenDelta, cause: str) -> None:
    assert delta.finish_reason == "error" and delta.error_code == ENGINE_UNAVAILABLE
    assert delta.error == f"no engine is up: {cause}"


def test_an_engine_that_never_starts_answers_queued_requests_unavailable() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    client.send(make_request("queued", max_tokens=5))  # before the worker is up
    config = fast_restarts(engine_wait_s=0.2, engine_max_failed_starts=1000)
    worker = WorkerThread(bus, NeverStartingBackend(), config)
    worker.thread.start()
    client.wait_finished(["queued"])
    _assert_unavailable(_terminal(client, "queued"), CAUSE)
    client.send(make_request("later", max_tokens=5))  # while it stays down: at once
    client.wait_finished(["later"])
    _assert_unavailable(_terminal(client, "later"), CAUSE)
    stats = worker.worker.stats
    assert not stats.ready and stats.healthy  # it keeps trying
    assert worker.worker.unavailable_message == f"no engine is up: {CAUSE}"
    worker.stop()


def test_a_dead_engine_not_back_within_the_wait_fails_its_requests_then_serves_again() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    engine = RestartableFakeBackend(failed_starts=1_000_000, step_s=0.005)
    config = fast_restarts(
        engine_wait_s=0.2, engine_max_failed_starts=1_000_000, engine_restart_max_s=0.05
    )
    worker = WorkerThread(bus, engine, config).start()
    client.send(make_request("r", max_tokens=10_000))
    client.wait(lambda: len(engine._running) == 1, 5, "for it to run")
    engine.crash()
    client.wait_finished(["r"])
    _assert_unavailable(_terminal(client, "r"), "the engine died")
    assert worker.worker.stats.healthy
    engine.failed_starts = 0  # the next restart comes up
    client.wait(lambda: worker.worker.stats.ready, 5, "for the engine to be back")
    assert worker.worker.unavailable_message is None
    client.send(make_request("after", max_tokens=5))
    client.wait_finished(["after"])
    after = _terminal(client, "after")
    assert after.finish_reason == "length" and after.error_code is None
    worker.stop()
