"""Overload: with the lane's TTFT target set low, a burst beyond capacity gets 429s before
any compute, and the admitted requests meet the target.

The real gateway on a loopback server, driven by the `openai` SDK, and a real engine
worker on the sim backend (a fixed step time, two running slots: a known capacity) over
the memory bus, as `sluice serve` wires them. Refused requests are counted where they
would have left a trace: the lane's topic, the engine's submits, the usage topic.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest

from sluice.api.app import create_app
from sluice.api.slo import SloAdmission
from sluice.bus.base import TopicPartition
from sluice.bus.codec import decode_as
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC, Lane, TopicLayout, request_topic
from sluice.consumers.engine_worker import EngineWorkerConfig
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import ServerThread, served_model
from tests.unit.consumers.engine_harness import WorkerThread
from tests.unit.consumers.sim_engine import RecordingSimBackend
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

TARGET_S = 6.0  # the standard lane's TTFT target
# the sim's step: 10 tokens take 2 s, two run at once: 1 request/s; long beside the
# stalls of a busy test host, which the prediction cannot know of
STEP_S = 0.2
MAX_TOKENS = 10
WARMUP = 8  # a backlog for a few seconds: the worker measures its rate
BURST = 16
PROMPT = "Tell me about queues " * 4


@dataclass
class Outcome:
    status: int  # 200, or the error's status
    code: str | None = None
    retry_after: str | None = None


@pytest.fixture
def stack() -> Iterator[tuple[ServerThread, WorkerThread, MemoryEventBus, SloAdmission]]:
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=1, pools=("tiny",)).specs())
    config = EngineWorkerConfig(poll_timeout_s=0.02, tick_s=0.01, heartbeat_s=0.1)
    backend = RecordingSimBackend(step_s=STEP_S, max_running=2)
    worker = WorkerThread(bus, backend, config, pool="tiny")
    worker.start()
    settings = gateway_settings(slo_admission=True, ttft_target_standard_s=TARGET_S)
    app = create_app(settings, bus, [served_model("tiny", max_model_len=1024)])
    with ServerThread(app) as server:
        pools = app.state.gateway.service.slo
        assert pools is not None and "tiny" in pools.pools  # the served model's pool
        yield server, worker, bus, pools.pools["tiny"]
    worker.stop()
    bus.close()


def stream(base_url: str) -> Outcome:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        try:
            chunks = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=MAX_TOKENS,
                stream=True,
            )
        except openai.APIStatusError as exc:
            code = exc.body.get("code") if isinstance(exc.body, dict) else None
            return Outcome(exc.status_code, code, exc.response.headers.get("retry-after"))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        return Outcome(200)


def usage_records(bus: MemoryEventBus) -> list[UsageRecord]:
    group = f"test-usage-{uuid.uuid4().hex[:8]}"
    consumer = bus.consumer(group, [USAGE_TOPIC], offset_reset="earliest")
    try:
        return [decode_as(UsageRecord, r.value) for r in consumer.poll(0.5, 10_000)]
    finally:
        consumer.close()


def test_a_burst_past_capacity_is_refused_before_publishing_and_the_rest_meet_the_target(
    stack: tuple[ServerThread, WorkerThread, MemoryEventBus, SloAdmission],
) -> None:
    server, worker, bus, slo = stack
    backend = worker.backend
    assert isinstance(backend, RecordingSimBackend)
    lane = TopicPartition(request_topic(Lane.STANDARD, "tiny"), 0)

    # a cold fleet has no measured rate: nothing is refused until a backlog was served
    with ThreadPoolExecutor(WARMUP) as pool:
        warmup = list(pool.map(lambda _: stream(server.base_url), range(WARMUP)))
    assert [o.status for o in warmup] == [200] * WARMUP
    wait_until(
        lambda: slo.fleet is not None and slo.fleet.prefill_tokens_per_s,
        10,
        "the worker to report its prefill rate",
    )
    wait_until(lambda: not worker.worker.stats.held, 30, "the warm-up to end")
    published_before = bus.end_offset(lane)
    assert published_before == len(backend.submitted) == WARMUP

    with ThreadPoolExecutor(BURST) as pool:
        burst = list(pool.map(lambda _: stream(server.base_url), range(BURST)))

    admitted = [o for o in burst if o.status == 200]
    refused = [o for o in burst if o.status != 200]
    assert refused and len(admitted) >= 2, [o.status for o in burst]
    assert {(o.status, o.code) for o in refused} == {(429, "server_overloaded")}
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in refused)
    # refused before publishing: nothing reached the lane's topic or the engine for them
    assert bus.end_offset(lane) - published_before == len(admitted)
    assert len(backend.submitted) - WARMUP == len(admitted)
    # no usage for them either: one record per request that ran
    ran = WARMUP + len(admitted)
    wait_until(lambda: len(usage_records(bus)) == ran, 30, "every admitted request's usage")
    # the admitted requests meet the target the refusals protect: their time to first
    # token from the gateway's publish (what the prediction covers; the client's own
    # figure adds its HTTP round trip on a shared test host)
    burst_usage = [u for u in usage_records(bus) if u.request_id in burst_ids(backend)]
    ttfts = [(u.timings.first_token_ms or 0) - u.timings.queued_ms for u in burst_usage]
    assert len(ttfts) == len(admitted)
    assert all(0 < t <= TARGET_S * 1000 for t in ttfts), ttfts


def burst_ids(backend: RecordingSimBackend) -> set[str]:
    return {r.request_id for r in backend.submitted[WARMUP:]}
