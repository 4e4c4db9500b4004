"""Runs engine workers in threads over a bus and reads what the gateway and billing see."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sluice.bus.base import EventBus, TopicPartition, TopicSpec
from sluice.bus.codec import decode_as, encode
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import Cancel, GenerateRequest, SamplingSpec, UsageRecord
from sluice.bus.partitioner import partition_for
from sluice.bus.topics import (
    CONTROL_TOPIC,
    USAGE_TOPIC,
    Lane,
    TopicLayout,
    pool_id,
    reply_topic,
    request_topic,
)
from sluice.consumers.engine_worker import EngineWorker, EngineWorkerConfig
from sluice.consumers.progress import MemoryProgressStore, ProgressStore
from sluice.engine.backends.base import EngineBackend
from tests.unit.consumers.engine_fakes import GatewayView
from tests.unit.consumers.sim_engine import RecordingSimBackend
from tests.waiting import wait_until

GATEWAY = "gw1"
MODEL = "fake"
POOL = pool_id(MODEL)  # the pool the workers serve: `make_request`'s model's


def make_request(
    request_id: str,
    *,
    tenant: str = "t1",
    lane: Lane = Lane.INTERACTIVE,
    prompt: list[int] | None = None,
    max_tokens: int = 8,
    **fields: Any,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        tenant_id=tenant,
        model=MODEL,
        lane=lane,
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3, 4],
        sampling=SamplingSpec(temperature=0.0, max_tokens=max_tokens),
        reply_to=GATEWAY,
        created_ms=int(time.time() * 1000),
        **fields,
    )


def create_topics(
    bus: EventBus, request_partitions: int = 2, pools: tuple[str, ...] = (POOL,)
) -> None:
    layout = TopicLayout(request_partitions=request_partitions, pools=pools)
    bus.create_topics([*layout.specs(), TopicSpec(reply_topic(GATEWAY), 1)])


class WorkerThread:
    def __init__(
        self,
        bus: EventBus,
        backend: EngineBackend | None = None,
        config: EngineWorkerConfig | None = None,
        progress: ProgressStore | None = None,
        worker_id: str = "w1",
        pool: str = POOL,
    ) -> None:
        self.backend = backend or RecordingSimBackend()
        self.worker = EngineWorker(
            bus,
            self.backend,
            config or EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01),
            progress or MemoryProgressStore(),
            worker_id,
            pool=pool,
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"worker-{worker_id}", daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def start(self, ready_timeout_s: float = 10.0) -> WorkerThread:
        self.thread.start()
        assert self.worker.wait_ready(ready_timeout_s), "worker got no partitions"
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        assert self.worker.drain(timeout_s), "worker did not stop"
        self.thread.join(5.0)
        assert self.error is None, self.error

    def abandon(self) -> None:
        self.worker.abandon()
        self.thread.join(10.0)


class Client:
    """Publishes requests and cancels; reads the reply topic and the usage topic."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.view = GatewayView()
        self.usage: list[UsageRecord] = []
        suffix = uuid.uuid4().hex[:8]
        self._replies = bus.consumer(f"test-gateway-{suffix}", [reply_topic(GATEWAY)])
        self._usage = bus.consumer(f"test-billing-{suffix}", [USAGE_TOPIC])

    def send(self, *requests: GenerateRequest) -> None:
        for request in requests:
            key = request.tenant_id.encode()
            topic = request_topic(request.lane, pool_id(request.model))
            self.bus.publish(topic, encode(request), key=key).result(10)

    def cancel(
        self, request_id: str | None = None, batch_id: str | None = None, tenant: str = "t1"
    ) -> None:
        cancel = Cancel(request_id=request_id, batch_id=batch_id, tenant_id=tenant)
        self.bus.publish(CONTROL_TOPIC, encode(cancel)).result(10)

    def pump(self, timeout_s: float = 0.02) -> None:
        for record in self._replies.poll(timeout_s, 500):
            self.view.add_batch(record.value)
        for record in self._usage.poll(min(timeout_s, 0.01), 500):
            self.usage.append(decode_as(UsageRecord, record.value))

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting {what}"
            self.pump()

    def wait_finished(self, request_ids: list[str], timeout_s: float = 10.0) -> None:
        def done() -> bool:
            streams = self.view.streams
            usage_ids = {u.request_id for u in self.usage}
            return all(
                rid in streams and streams[rid].finish_reason is not None and rid in usage_ids
                for rid in request_ids
            )

        def missing() -> str:
            finished = {u.request_id for u in self.usage}
            return f"for {[rid for rid in request_ids if rid not in finished]} (no usage yet)"

        try:
            self.wait(done, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc} {missing()}") from None

    def close(self) -> None:
        self._replies.close()
        self._usage.close()


def committed(bus: MemoryEventBus, group: str = f"engine.{POOL}") -> dict[TopicPartition, int]:
    """The group's committed offsets (read from the fake broker)."""
    with bus._cond:
        return dict(bus._groups[group].committed)


def wait_controls_read(bus: MemoryEventBus, timeout_s: float = 10.0) -> None:
    """Until every worker's control consumer has read the control topic to its end. A poll
    round hands its cancels to the worker before its requests, so a request sent after
    this meets every cancel sent before it."""
    tps = [TopicPartition(CONTROL_TOPIC, p) for p in range(bus.num_partitions(CONTROL_TOPIC))]
    ends = {tp: bus.end_offset(tp) for tp in tps}

    def read() -> bool:
        with bus._cond:
            members = [
                member
                for group_id, group in bus._groups.items()
                if group_id.startswith("engine-control")
                for member in group.members.values()
            ]
            return bool(members) and all(
                (m.position(tp) or 0) >= end for m in members for tp, end in ends.items()
            )

    wait_until(read, timeout_s, "the workers to read the control topic", interval_s=0.001)


def partition_tenants(num_partitions: int = 2) -> list[str]:
    """One tenant name per partition (requests are keyed by tenant)."""
    found: dict[int, str] = {}
    for i in range(1000):
        name = f"tenant{i}"
        found.setdefault(partition_for(name.encode(), num_partitions), name)
        if len(found) == num_partitions:
            break
    return [found[p] for p in range(num_partitions)]


def assert_billed_as_shown(client: Client, request_id: str, prompt_tokens: int) -> None:
    """Σ of the request's usage records (one per attempt) = the usage on the terminal
    delta its client is shown: the prompt once, each token the client was sent once."""
    records = [u for u in client.usage if u.request_id == request_id]
    shown = client.view.streams[request_id].deltas[-1].usage
    assert shown is not None and shown.prompt_tokens == prompt_tokens
    billed = tuple(
        sum(getattr(u, f) for u in records)
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens")
    )
    assert billed == (shown.prompt_tokens, shown.cached_tokens, shown.completion_tokens), records
