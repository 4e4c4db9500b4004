"""The engine worker over the memory bus and the sim engine: streams, coalescing, usage."""

from __future__ import annotations

from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import Lane
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request
from tests.unit.consumers.sim_engine import sim_reply


def test_requests_stream_greedy_tokens_with_one_usage_record_each() -> None:
    bus = MemoryEventBus()
    create_topics(bus)
    worker = WorkerThread(bus).start()
    client = Client(bus)
    requests = [make_request(f"r{i}", prompt=[i, i + 1], max_tokens=6) for i in range(5)]
    client.send(*requests)
    client.wait_finished([r.request_id for r in requests])
    worker.stop()
    client.pump()
    for r in requests:
        stream = client.view.streams[r.request_id]
        assert (stream.token_ids, stream.text) == sim_reply(r.prompt_token_ids, 6)
        assert stream.finish_reason == "length" and stream.num_terminal == 1
        assert stream.deltas[-1].usage is not None
        assert stream.deltas[-1].usage.completion_tokens == 6
    by_id = {u.request_id: u for u in client.usage}
    assert len(client.usage) == len(requests) == len(by_id)
    assert all(u.completion_tokens == 6 and u.prompt_tokens == 2 for u in by_id.values())
    assert all(u.lane == Lane.INTERACTIVE and u.timings.first_token_ms for u in by_id.values())
