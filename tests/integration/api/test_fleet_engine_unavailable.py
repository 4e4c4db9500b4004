"""Fleet mode on Kafka (Tansu): the gateway and an engine worker whose engine cannot come up
(an upstream server nobody answers). Its requests end 503 engine_unavailable, naming the
cause, once the worker has waited `engine_wait_s` for the engine, not 504 past their
deadline; and once the gateway has heard that verdict, a streamed request gets the plain
503 status too, rather than a 200 whose stream ends in an error event."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import openai
import pytest

from sluice.api.app import create_app
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.topics import TopicLayout
from sluice.consumers.worker_config import EngineWorkerConfig
from sluice.engine.backends.upstream_backend import UpstreamEngineBackend
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import ServerThread, served_model
from tests.unit.consumers.engine_harness import WorkerThread

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}


@pytest.fixture
def kafka_bus(dedicated_kafka: str) -> Iterator[KafkaEventBus]:
    bus = KafkaEventBus(KafkaConfig(bootstrap=dedicated_kafka, client_id="sluice-fleet-503"))
    layout = TopicLayout(request_partitions=1, control_partitions=1, pools=("tiny",))
    bus.create_topics(layout.specs())
    yield bus
    bus.close()


def _nobody_listens() -> str:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{closed.getsockname()[1]}"


@pytest.fixture
def upstream() -> str:
    return _nobody_listens()


@pytest.fixture
def down_worker(kafka_bus: KafkaEventBus, upstream: str) -> Iterator[WorkerThread]:
    """`sluice worker engine --upstream-url <nobody>`: alive, restarting its engine."""
    backend = UpstreamEngineBackend([upstream], health_interval_s=0.1, restart_timeout_s=0.2)
    config = EngineWorkerConfig(
        group_id=f"engine-{uuid.uuid4().hex[:8]}",
        poll_timeout_s=0.05,
        tick_s=0.01,
        engine_wait_s=1.0,
        engine_restart_initial_s=0.05,
        engine_restart_max_s=0.2,
        engine_max_failed_starts=1_000_000,  # it keeps trying while the test runs
    )
    worker = WorkerThread(kafka_bus, backend, config, worker_id="down", pool="tiny")
    worker.thread.start()  # never ready: no engine comes up
    yield worker
    worker.stop(timeout_s=10)


def _assert_names_the_cause(error: openai.APIError, upstream: str) -> None:
    assert (error.type, error.code) == ("service_unavailable", "engine_unavailable"), error
    assert isinstance(error.body, dict)
    message = error.body["message"]
    assert message.startswith(f"no engine is up: the upstream server at {upstream}")
    assert "--upstream-url" in message


def test_requests_no_engine_can_serve_end_503_and_streams_get_the_plain_status(
    kafka_bus: KafkaEventBus, down_worker: WorkerThread, upstream: str
) -> None:
    # the deadline (and its 504) is far past the worker's engine_wait_s
    settings = gateway_settings(request_timeout_s=60.0, deadline_grace_s=5.0)
    app = create_app(settings, kafka_bus, [served_model("tiny")])
    with ServerThread(app) as server:
        base = f"{server.base_url}/v1"
        with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0, timeout=120) as client:
            # the gateway has heard nothing yet: a stream opens (200) and ends in the error
            stream = client.chat.completions.create(**CHAT, stream=True)
            with pytest.raises(openai.APIError) as in_stream:
                list(stream)
            assert not isinstance(in_stream.value, openai.APIStatusError)
            _assert_names_the_cause(in_stream.value, upstream)

            with pytest.raises(openai.APIStatusError) as refused:
                client.chat.completions.create(**CHAT)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"]
            _assert_names_the_cause(refused.value, upstream)

            # the verdict is known now: the stream is refused before it opens
            with pytest.raises(openai.APIStatusError) as before_stream:
                client.chat.completions.create(**CHAT, stream=True)
            assert before_stream.value.status_code == 503
            _assert_names_the_cause(before_stream.value, upstream)
    assert down_worker.worker.stats.healthy  # it is still there, restarting its engine
