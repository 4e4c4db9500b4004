"""Gateway app on a MemoryEventBus with a fake engine worker behind it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.settings import GatewaySettings
from tests.unit.api.fakes import FakeEngineWorker, served_model

API_KEY = "sk-test-key"


def gateway_settings(**overrides: object) -> GatewaySettings:
    values: dict[str, object] = {
        "api_keys": [API_KEY],
        "request_timeout_s": 30.0,
        "deadline_grace_s": 0.5,
        "max_body_bytes": 64 * 1024,
        # a dropped stream is cancelled soon after: tests of resuming set their own window
        "stream_resume_window_s": 0.2,
    }
    values.update(overrides)
    return GatewaySettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def memory_bus() -> Iterator[MemoryEventBus]:
    bus = MemoryEventBus()
    bus.create_topics(
        TopicLayout(request_partitions=2, tokens_partitions=1, pools=("tiny",)).specs()
    )
    yield bus
    bus.close()


@pytest.fixture
def engine(memory_bus: MemoryEventBus) -> Iterator[FakeEngineWorker]:
    worker = FakeEngineWorker(memory_bus).start()
    yield worker
    worker.stop()


@pytest.fixture
def settings() -> GatewaySettings:
    return gateway_settings()


@pytest.fixture
def app(settings: GatewaySettings, memory_bus: MemoryEventBus, engine: FakeEngineWorker) -> FastAPI:
    return create_app(settings, memory_bus, [served_model("tiny", max_model_len=256)])


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
