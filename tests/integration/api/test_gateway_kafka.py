"""The gateway over real Kafka (Tansu): the same flow as on the memory bus.

The gateway's reply consumer and the fake engine worker join their groups on the
broker; the official SDK streams a chat completion through lane topic → engine →
this gateway's reply topic, and a client disconnect reaches the engine as a Cancel.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from api.app import create_app
from bus.kafka import KafkaConfig, KafkaEventBus
from bus.topics import Lane, TopicLayout, request_topic
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def kafka_bus(dedicated_kafka: str) -> Iterator[KafkaEventBus]:
    bus = KafkaEventBus(KafkaConfig(bootstrap=dedicated_kafka, client_id="sluice-api-test"))
    bus.create_topics(TopicLayout(request_partitions=1, control_partitions=1).specs())
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
            assert topic == request_topic(Lane.BATCH)
            assert req.reply_to == gateway_id

            worker.mode = "hang"
            headers = {"Authorization": f"Bearer {API_KEY}"}
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
            http = httpx.Client(base_url=server.base_url, headers=headers)
            streamed = http.stream("POST", "/v1/chat/completions", json={**body, "stream": True})
            with http, streamed as r:
                next(r.iter_lines())
                worker.wait_for_requests(2, timeout_s=15)
            [cancel] = worker.wait_for_cancels(1, timeout_s=15)
            assert cancel.request_id == worker.requests[1][1].request_id
    finally:
        worker.stop()
