"""The gateway over real Kafka (Tansu): the same flow as on the memory bus.

The gateway's reply consumer and the fake engine worker join their groups on the
broker; the official SDK streams a chat completion through lane topic → engine →
this gateway's reply topic, and a client disconnect reaches the engine as a Cancel.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.faults_infra import Broker, TcpProxy
from sluice.api.app import create_app
from sluice.bus.base import Consumer
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.topics import Lane, TopicLayout, request_topic
from sluice.tansu import free_port
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def kafka_bus(dedicated_kafka: str) -> Iterator[KafkaEventBus]:
    bus = KafkaEventBus(KafkaConfig(bootstrap=dedicated_kafka, client_id="sluice-api-test"))
    bus.create_topics(
        TopicLayout(request_partitions=1, control_partitions=1, pools=("tiny",)).specs()
    )
    yield bus
    bus.close()


def test_chat_stream_and_cancel_over_kafka(kafka_bus: KafkaEventBus) -> None:
    worker = FakeEngineWorker(kafka_bus, group_id=f"fake-engine-{uuid.uuid4().hex[:8]}")
    worker.start()
    gateway_id = f"gw{uuid.uuid4().hex[:8]}"
    app = create_app(gateway_settings(gateway_id=gateway_id), kafka_bus, [served_model("tiny")])
    try:
        with ServerThread(app) as server:
            base = f"{server.base_url}/v1"
            with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0) as client:
                stream = client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "Hi"}],
                    stream=True,
                    stream_options={"include_usage": True},
                    service_tier="flex",
                )
                chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "Hello world"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 11
            [(topic, req)] = worker.requests
            assert topic == request_topic(Lane.BATCH, "tiny")
            assert req.reply_to == gateway_id

            worker.mode = "hang"
            headers = {"Authorization": f"Bearer {API_KEY}"}
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
            http = httpx.Client(base_url=server.base_url, headers=headers)
            streamed = http.stream("POST", "/v1/chat/completions", json={**body, "stream": True})
            with http, streamed as r:
                next(r.iter_lines())
                worker.wait_for_requests(2, timeout_s=15)
            # sent again with the gateway's heartbeats while no delta answered it
            cancels = worker.wait_for_cancels(1, timeout_s=15)
            assert {c.request_id for c in cancels} == {worker.requests[1][1].request_id}
    finally:
        worker.stop()


class GatewayConsumersSeen:
    """The bus, keeping the gateway's reply consumers it makes: a test sees one lose its
    group (its assignment empties when its session times out)."""

    def __init__(self, bus: KafkaEventBus) -> None:
        self.bus = bus
        self.gateway_consumers: list[Consumer] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bus, name)

    def consumer(self, group_id: str, topics: Sequence[str], **kwargs: Any) -> Consumer:
        consumer = self.bus.consumer(group_id, topics, **kwargs)
        if group_id.startswith("gateway-"):
            self.gateway_consumers.append(consumer)
        return consumer


def test_a_stream_survives_a_broker_outage_longer_than_the_session_timeout(
    tmp_path: Path,
) -> None:
    """Every client reaches the broker through a proxy that is cut until the gateway's
    reply consumer has lost its group (its session timed out): it rejoins, and the
    stream still gets every token, none twice."""
    kafka_port = free_port()
    broker = Broker(kafka_port, tmp_path / "tansu.log").start()
    proxy = TcpProxy(broker.port, port=kafka_port)
    kafka = KafkaEventBus(KafkaConfig(bootstrap=f"127.0.0.1:{kafka_port}", client_id="outage"))
    bus = GatewayConsumersSeen(kafka)
    bus.create_topics(
        TopicLayout(request_partitions=1, control_partitions=1, pools=("tiny",)).specs()
    )
    reply = "".join(f"{i:04d} " for i in range(300))  # 1,500 tokens of the byte tokenizer
    worker = FakeEngineWorker(bus, reply=reply, step_s=0.01, group_id="fake-engine-outage")
    settings = gateway_settings(request_timeout_s=120.0)
    app = create_app(settings, bus, [served_model("tiny", max_model_len=4096)])
    try:
        worker.start()
        with ServerThread(app) as server:
            body = {"model": "tiny", "prompt": "x", "max_tokens": len(reply), "stream": True}
            text = ""
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                              headers=headers, timeout=120) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "choices" in chunk, chunk
                        text += chunk["choices"][0]["text"]
                        if len(text) >= 100 and proxy.port == kafka_port:
                            proxy.cut()
                            [reply_consumer] = bus.gateway_consumers
                            wait_until(
                                lambda: not reply_consumer.assignment(),  # noqa: B023
                                60,
                                "the gateway's reply consumer to lose its group",
                            )
                            proxy.restore()
                            kafka_port = -1  # once
            assert text == reply
    finally:
        worker.stop()
        bus.close()
        proxy.close()
        broker.stop()


def test_a_request_answered_503_in_an_outage_never_runs_later(tmp_path: Path) -> None:
    """The gateway tells the client 503 when its request is not published in time; the
    bus must then drop it, not deliver it once the broker is back (it would run and be
    billed for a client that was told it failed)."""
    kafka_port = free_port()
    broker = Broker(kafka_port, tmp_path / "tansu.log").start()
    proxy = TcpProxy(broker.port, port=kafka_port)
    config = KafkaConfig(bootstrap=f"127.0.0.1:{kafka_port}", client_id="outage-503")
    bus = KafkaEventBus(dataclasses.replace(config, message_timeout_ms=2000))
    bus.create_topics(
        TopicLayout(request_partitions=1, control_partitions=1, pools=("tiny",)).specs()
    )
    worker = FakeEngineWorker(bus, group_id="fake-engine-503")
    app = create_app(gateway_settings(publish_timeout_s=2.0), bus, [served_model("tiny")])
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    try:
        worker.start()
        with ServerThread(app) as server:
            url = f"{server.base_url}/v1/completions"
            assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
            proxy.cut()
            r = httpx.post(url, json=body, headers=headers, timeout=30)
            assert r.status_code == 503, r.text
            refused = r.headers["x-request-id"]
            proxy.restore()
            # a request after the outage goes through, and by then the one refused
            # during it would have arrived first (same tenant, same partition)
            deadline = time.monotonic() + 60
            while True:
                after = httpx.post(url, json=body, headers=headers, timeout=30)
                if after.status_code == 200 or time.monotonic() > deadline:
                    break
            assert after.status_code == 200, after.text
            seen = {req.request_id for _, req in worker.requests}
            assert after.headers["x-request-id"] in seen
            assert refused not in seen
    finally:
        worker.stop()
        bus.close()
        proxy.close()
        broker.stop()
