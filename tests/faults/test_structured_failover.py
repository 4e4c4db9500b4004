"""A JSON-schema stream survives a kill -9 of its engine worker: on a `sluice up` fleet
(Kafka (Tansu), Redis, PostgreSQL; `benchmarks.faults_infra`), the worker streaming a
greedy chat completion under `response_format` json_schema is killed mid-stream; another
worker resumes it (prompt + the tokens published, its grammar replaying them), and the
client gets exactly the text of an unfaulted run of the same request, which validates.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from benchmarks.faults import create_database, drop_database, kill_worker
from benchmarks.faults_infra import API_KEY, Fleet
from sluice.bus.codec import decode_as
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleet_services")]

# bounded everywhere (fixed counts, fixed-length patterns) so even random weights end it,
# and long enough (~1,600 characters) that the kill lands while the engine still generates
ROWS = 40
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "word": {"type": "string", "pattern": "^[a-z]{12}$"},
                    "ok": {"type": "boolean"},
                },
                "required": ["code", "word", "ok"],
                "additionalProperties": False,
            },
            "minItems": ROWS,
            "maxItems": ROWS,
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}
KILL_AFTER_CHUNKS = 5
STREAM_TIMEOUT_S = 180.0  # a failover waits out the dead worker's Kafka session


def _body() -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "List the inventory rows as JSON."}],
        "max_tokens": 1800,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "inventory", "schema": SCHEMA, "strict": True},
        },
    }


def _stream(
    client: openai.OpenAI, fleet: Fleet | None = None
) -> tuple[str, str | None, int, str, str]:
    """(text, finish_reason, characters received before the kill, what was killed, request
    id); with `fleet`, kill -9 the busiest engine worker once KILL_AFTER_CHUNKS arrived."""
    parts: list[str] = []
    finish: str | None = None
    before, killed = -1, ""
    raw = client.chat.completions.with_raw_response.create(**_body(), stream=True)
    request_id = raw.headers.get("x-request-id", "")
    for chunk in raw.parse():
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
        if fleet is not None and not killed and len(parts) >= KILL_AFTER_CHUNKS:
            before, killed = len("".join(parts)), kill_worker(fleet)
    return "".join(parts), finish, before, killed, request_id


def _attempts(fleet: Fleet, request_id: str, timeout_s: float = 90.0) -> set[int]:
    """The attempts of `request_id` that wrote usage records, once a resumed one did."""
    bus = KafkaEventBus(KafkaConfig(bootstrap=fleet.kafka_bootstrap, client_id="structured"))
    consumer = bus.consumer(f"structured-usage-{uuid.uuid4().hex[:6]}", [USAGE_TOPIC])
    attempts: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and max(attempts, default=0) < 1:
            for record in consumer.poll(0.5):
                usage = decode_as(UsageRecord, record.value)
                if usage.request_id == request_id:
                    attempts.add(usage.attempt)
    finally:
        consumer.close()
        bus.close()
    return attempts


@pytest.mark.timeout(900)
def test_a_json_schema_stream_resumes_identically_after_a_worker_kill(tmp_path: Path) -> None:
    db_name = f"sluice_structured_{uuid.uuid4().hex[:8]}"
    fleet = Fleet(tmp_path / "fleet", create_database(db_name))
    try:
        fleet.start()
        client = openai.OpenAI(
            base_url=f"{fleet.base_url}/v1", api_key=API_KEY, timeout=STREAM_TIMEOUT_S
        )
        reference, reason, _, _, _ = _stream(client)
        assert reason == "stop", reference
        instance = json.loads(reference)
        jsonschema.validate(instance, SCHEMA)

        started = time.monotonic()
        text, reason, before, killed, request_id = _stream(client, fleet)
        seconds = time.monotonic() - started
        print(f"{killed} after {before} characters; the stream took {seconds:.1f} s")
        assert killed.startswith("kill -9 engine worker"), killed
        assert 0 < before < len(reference), "killed after the stream ended"
        assert reason == "stop"
        assert text == reference, f"\nfaulted:   {text!r}\nunfaulted: {reference!r}"
        # the kill hit the attempt that generated it: another worker resumed it
        assert max(_attempts(fleet, request_id)) >= 1, "no resumed attempt"
    except BaseException:
        print(fleet.log_tail())
        raise
    finally:
        fleet.stop()
        drop_database(db_name)
