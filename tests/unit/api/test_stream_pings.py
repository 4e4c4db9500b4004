"""Keep-alive pings in a stream whose events carry ids (resumable streams): the openai SDK
reads through them. A ping ended by a blank line made its decoder dispatch an empty event
with the last id, whose empty data it then failed to parse as JSON."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from sluice.api.app import create_app
from sluice.bus.memory import MemoryEventBus
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model


@pytest.fixture
def slow_engine(memory_bus: MemoryEventBus) -> Iterator[FakeEngineWorker]:
    worker = FakeEngineWorker(memory_bus, reply="one two three", step_s=0.2).start()
    yield worker
    worker.stop()


def test_sdk_streams_through_pings_between_events(
    memory_bus: MemoryEventBus, slow_engine: FakeEngineWorker
) -> None:
    settings = gateway_settings(sse_ping_s=0.03)
    app = create_app(settings, memory_bus, [served_model("tiny", max_model_len=256)])
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        for api in ("chat", "responses"):
            if api == "chat":
                stream = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                events = client.responses.create(model="tiny", input="hi", stream=True)
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text == "one two three", api
