"""Failover with the memory bus and the in-memory progress store; zombie fencing."""

from __future__ import annotations

from sluice.bus.memory import MemoryEventBus
from sluice.consumers.progress import MemoryProgressStore
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request
from tests.unit.consumers.failover import run_failover
from tests.unit.consumers.sim_engine import RecordingSimBackend


def test_a_dead_workers_stream_continues_on_another_with_every_token_once() -> None:
    store = MemoryProgressStore()
    run_failover(store, store, "fo-memory")


class SharedMemoryProgressStore(MemoryProgressStore):
    """Stands for a store other processes see (Redis): a drained worker hands over."""

    in_process = False


def test_a_request_outlasting_the_drain_continues_on_another_worker_with_every_token_once() -> None:
    store = SharedMemoryProgressStore()
    run_failover(store, store, "fo-drain", drain=True)


def test_a_zombie_attempt_is_fenced_and_aborts_without_a_terminal_delta() -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    store = MemoryProgressStore()
    backend = RecordingSimBackend(step_s=0.01)
    worker = WorkerThread(bus, backend, progress=store).start()
    client.send(make_request("z", max_tokens=500))
    client.wait(lambda: "z" in client.view.streams and len(client.view.streams["z"].token_ids) > 3)
    [start] = store.begin_attempts([("z", 0)])  # another worker took over
    assert start.attempt == 1
    client.wait(lambda: "z" in backend.aborts)
    worker.stop()
    client.pump()
    stream = client.view.streams["z"]
    assert stream.finish_reason is None  # the zombie said nothing final to the client
    # nor bills: the attempt that took over bills the zombie's published tokens (its
    # `superseded`), the prompt with its own end, so the ledger is what the client is shown
    assert not [u for u in client.usage if u.request_id == "z"]
    assert start.superseded is not None and start.superseded[0] == 0
    assert 0 < start.superseded[1] <= len(stream.token_ids)
