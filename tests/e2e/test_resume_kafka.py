"""Two `sluice gateway` processes and an engine worker on Kafka (Tansu), Redis and
PostgreSQL: gateway A is killed -9 mid-stream, the client resumes on gateway B with
`Last-Event-ID`, and what it was shown in all equals an uninterrupted run, billed once."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.procs import SluiceProcess, fleet_database, free_port, wait_ready
from tests.e2e.test_tenancy_processes import sluice_cli
from tests.integration.storage.stores import REDIS_URL
from tests.sse import Events, read_events
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
MAX_TOKENS = 2000
GATEWAY_TTL_S = 0.5
# short, so that the killed gateway is judged gone while its stream still runs on the
# gateway that took it over: the workers let it run because that one names it
RESUME_WINDOW_S = 1.5


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    with fleet_database("sluice_resume") as url:
        yield url


def _body() -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _stream(port: int, key: str, last_id: str | None = None) -> tuple[str, Events]:
    headers = {"Authorization": f"Bearer {key}"}
    if last_id is not None:
        headers["Last-Event-ID"] = last_id
    events: Events = []
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.stream("POST", url, json=_body(), headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        read_events(r.iter_lines(), events)
    return r.headers["x-request-id"], events


def _chunks(events: Events) -> list[dict[str, Any]]:
    return [json.loads(d) for _, d in events if d != "[DONE]"]


def _text(events: Events) -> str:
    return "".join(c["delta"].get("content") or "" for ch in _chunks(events) for c in ch["choices"])


def _ledger(database_url: str, request_id: str) -> list[tuple[int, int, str]]:
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    query = sa.text(
        "SELECT prompt_tokens, completion_tokens, finish_reason FROM usage_ledger"
        " WHERE request_id = :request_id"
    )
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(query, {"request_id": request_id})]  # type: ignore[misc]
    finally:
        engine.dispose()


def test_a_stream_resumes_on_another_gateway_after_its_own_was_killed(
    database_url: str, dedicated_kafka: str, data_dir: Path, tmp_path: Path
) -> None:
    env = {
        "SLUICE_DATABASE_URL": database_url,
        "SLUICE_REDIS_URL": REDIS_URL,
        "SLUICE_KAFKA_BOOTSTRAP": dedicated_kafka,
        "SLUICE_DATA_DIR": str(data_dir),
        "SLUICE_STREAM_RESUME_WINDOW_S": str(RESUME_WINDOW_S),
        # a killed gateway without streams to resume would lose its requests within a second
        "SLUICE_HEARTBEAT_S": "0.25",
        "SLUICE_GATEWAY_TTL_S": str(GATEWAY_TTL_S),
    }
    sluice_cli(env, "migrate")
    key = json.loads(sluice_cli(env, "tenants", "create", "resume-e2e", "--json"))["api_key"]
    workers = [
        SluiceProcess(["worker", kind], tmp_path / f"{kind}.log", env).start()
        for kind in ("engine", "billing")
    ]
    ports = [free_port(), free_port()]
    gw_a, gw_b = (
        SluiceProcess(["gateway", "--port", str(p)], tmp_path / f"gateway-{p}.log", env).start()
        for p in ports
    )
    try:
        for port, proc in zip(ports, (gw_a, gw_b), strict=True):
            wait_ready(f"http://127.0.0.1:{port}", proc)
        _, reference = _stream(ports[1], key)  # uninterrupted, greedy: the text to match

        first: Events = []
        url = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.stream("POST", url, json=_body(), headers=headers, timeout=120) as r:
            assert r.status_code == 200, r.read()
            request_id = r.headers["x-request-id"]
            lines = r.iter_lines()
            read_events(lines, first, stop_after=6)
            assert gw_a.proc is not None
            os.killpg(gw_a.proc.pid, signal.SIGKILL)  # mid-stream
            gw_a.proc.wait()
            read_events(lines, first)  # what was on its way when it died
        assert first[-1][1] != "[DONE]"
        # the client comes back later than the workers' ttl for a silent gateway: the
        # scenario itself, not an ordering (only the resume window keeps the stream)
        time.sleep(1.2 * GATEWAY_TTL_S)
        last_id = [i for i, _ in first if i is not None][-1]
        resumed_id, rest = _stream(ports[1], key, last_id=last_id)

        assert _text(first) + _text(rest) == _text(reference), gw_b.output()[-3000:]
        assert rest[-1][1] == "[DONE]"
        # the chunks after the resume read as the same completion's
        assert len({(c["id"], c["created"]) for c in _chunks(first + rest)}) == 1
        [usage] = [c["usage"] for c in _chunks(rest) if c.get("usage")]
        assert usage["completion_tokens"] == MAX_TOKENS

        def rows() -> list[tuple[int, int, str]]:
            return _ledger(database_url, request_id)

        # one row: the resume published nothing, and it is what the client was shown
        assert wait_until(rows, 30, "the ledger row", interval_s=0.2) == [
            (usage["prompt_tokens"], usage["completion_tokens"], "length")
        ]
        assert not _ledger(database_url, resumed_id)
    finally:
        for proc in [gw_a, gw_b, *workers]:
            proc.stop()
