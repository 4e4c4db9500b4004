"""A gateway on a loopback port for the HTTP server's tests: `sluice.http_server` run in a
thread over a memory bus, a fake engine worker behind it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from sluice.http_server import GatewayServer, build_server
from tests.unit.api.conftest import gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, free_port, served_model
from tests.waiting import wait_until

START_TIMEOUT_S = 30.0


@contextmanager
def served_gateway(
    *,
    reply: str = "Hello world",
    step_s: float = 0.002,
    max_model_len: int = 256,
    **overrides: object,
) -> Iterator[tuple[GatewayServer, FakeEngineWorker]]:
    """The gateway serving model "tiny" (`max_model_len`) on a free port, its settings
    `gateway_settings(**overrides)`, started; a fake engine answering `reply` a token per
    `step_s`. Stopped, with the engine and the bus, on exit."""
    from sluice.api.app import create_app

    bus = MemoryEventBus()
    bus.create_topics(
        TopicLayout(request_partitions=2, tokens_partitions=1, pools=("tiny",)).specs()
    )
    engine = FakeEngineWorker(bus, reply=reply, step_s=step_s).start()
    settings = gateway_settings(port=free_port(), **overrides)
    model = served_model("tiny", max_model_len=max_model_len)
    server = build_server(create_app(settings, bus, [model]), settings)
    thread = threading.Thread(target=server.run, name="gateway-server", daemon=True)
    thread.start()
    wait_until(lambda: server.started, START_TIMEOUT_S, "the server to start")
    try:
        yield server, engine
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()
        bus.close()
