"""The failover scenario, shared by the memory and Redis progress-store tests.

Worker A streams a long greedy request and dies (no drain, no commit), or is drained
with the request still running at the drain's deadline (it hands the request over:
nothing final to the client, no usage, its offset uncommitted); worker B gets the
partition after the rebalance and resumes from the progress store with attempt + 1.
Under the gateway's rules (fence by attempt, dedupe by absolute offsets) the client
sees exactly the uninterrupted greedy output, and the usage records of both attempts
bill exactly the tokens it received.
"""

from __future__ import annotations

from sluice.bus.memory import MemoryEventBus
from sluice.consumers.progress import ProgressStore
from tests.unit.consumers.engine_fakes import FakeEngineBackend, greedy_tokens, token_text
from tests.unit.consumers.engine_harness import Client, WorkerThread, create_topics, make_request

MAX_TOKENS = 60


def run_failover(
    progress_a: ProgressStore, progress_b: ProgressStore, request_id: str, drain: bool = False
) -> None:
    bus = MemoryEventBus()
    create_topics(bus, request_partitions=1)
    client = Client(bus)
    request = make_request(request_id, prompt=[5, 6, 7], max_tokens=MAX_TOKENS)
    backend_a = FakeEngineBackend(step_s=0.01)
    a = WorkerThread(bus, backend_a, progress=progress_a, worker_id="a").start()
    client.send(request, make_request(f"{request_id}-short", prompt=[1], max_tokens=2))
    client.wait(lambda: len(client.view.streams.get(request_id, _NONE).token_ids) >= 15)
    if drain:  # SIGTERM, and the request outlasts the drain
        a.worker.stop(drain_timeout_s=0.05)
        a.thread.join(10)
        assert not a.thread.is_alive() and a.error is None
        assert request_id in backend_a.aborts
    else:
        a.abandon()  # kill -9: no terminal delta, no usage, no commit
    client.pump(0.05)  # everything A published before it died
    delivered_by_a = len(client.view.streams[request_id].token_ids)
    assert client.view.streams[request_id].finish_reason is None

    backend_b = FakeEngineBackend(step_s=0.002)
    b = WorkerThread(bus, backend_b, progress=progress_b, worker_id="b").start()
    client.wait_finished([request_id])
    b.stop()
    client.pump()

    expected = greedy_tokens(request.prompt_token_ids, MAX_TOKENS)
    stream = client.view.streams[request_id]
    assert stream.token_ids == expected
    assert stream.text == "".join(token_text(t) for t in expected)
    assert stream.finish_reason == "length" and stream.num_terminal == 1
    assert stream.attempt == 1
    assert stream.deltas[-1].usage is not None
    assert stream.deltas[-1].usage.completion_tokens == MAX_TOKENS

    resumed = next(r for r in backend_b.submitted if r.request_id == request_id)
    num_resumed = len(resumed.prompt_token_ids) - len(request.prompt_token_ids)
    assert resumed.prompt_token_ids == [*request.prompt_token_ids, *expected[:num_resumed]]
    assert 10 <= num_resumed <= delivered_by_a  # progress trails delivery by <= a step
    assert resumed.sampling_params.max_tokens == MAX_TOKENS - num_resumed
    assert resumed.num_resumed_tokens == num_resumed  # its text continues A's exactly
    usage = sorted((u for u in client.usage if u.request_id == request_id), key=lambda u: u.attempt)
    # A's usage comes from B (a kill -9 or a hand-over publishes none): what A's progress says it
    # published; together the attempts bill exactly the tokens the client received
    assert [(u.attempt, u.completion_tokens) for u in usage] == [
        (0, num_resumed),
        (1, MAX_TOKENS - num_resumed),
    ]
    # the prompt once, by the attempt that ends the request: the client is shown that sum
    assert [(u.prompt_tokens, u.cached_tokens) for u in usage] == [(0, 0), (3, 0)]
    assert usage[0].finish_reason == "error"
    assert usage[0].estimated and not usage[1].estimated  # A's own record would replace it
    shown = client.view.streams[request_id].deltas[-1].usage
    assert shown is not None
    assert (shown.prompt_tokens, shown.completion_tokens) == (
        sum(u.prompt_tokens for u in usage),
        sum(u.completion_tokens for u in usage),
    )
    # the short request finished on A before the kill or was redone on B: one terminal
    assert client.view.streams[f"{request_id}-short"].num_terminal == 1


class _Stream:
    token_ids: list[int] = []


_NONE = _Stream()
