"""Two `sluice gateway` processes on one Redis and PostgreSQL hold a tenant's concurrency
limit: 50 simultaneous requests against max-concurrency 10 → exactly 10 admitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import SluiceProcess, fleet_database, free_port, wait_ready
from tests.integration.storage.stores import REDIS_URL

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    with fleet_database("sluice_e2e") as url:
        yield url


def sluice_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_two_gateways_admit_exactly_the_concurrency_limit(
    database_url: str, dedicated_kafka: str, data_dir: Path, tmp_path: Path
) -> None:
    env = {
        "SLUICE_DATABASE_URL": database_url,
        "SLUICE_REDIS_URL": REDIS_URL,
        "SLUICE_KAFKA_BOOTSTRAP": dedicated_kafka,
        "SLUICE_DATA_DIR": str(data_dir),
        "SLUICE_GATEWAY_REPLICAS": "2",
    }
    sluice_cli(env, "migrate")
    created = json.loads(
        sluice_cli(env, "tenants", "create", "acme-e2e", "--max-concurrency", "10", "--json")
    )
    key = created["api_key"]
    worker = SluiceProcess(["worker", "engine"], tmp_path / "worker.log", env).start()
    ports = [free_port(), free_port()]
    gateways = [
        SluiceProcess(
            ["gateway", "--port", str(port)], tmp_path / f"gateway-{port}.log", env
        ).start()
        for port in ports
    ]
    try:
        for port, proc in zip(ports, gateways, strict=True):
            wait_ready(f"http://127.0.0.1:{port}", proc)
        statuses = _fire(ports, key, count=50)
    finally:
        for proc in [*gateways, worker]:
            proc.stop()
    assert statuses.count(200) == 10, statuses
    assert statuses.count(429) == 40, statuses


def _fire(ports: list[int], key: str, count: int) -> list[int]:
    """`count` streaming requests at once, alternating gateways; each holds its slot
    (long generation) until every request has had its answer."""
    barrier = threading.Barrier(count)
    answered = threading.Barrier(count)
    statuses: list[int] = []
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }

    def one(i: int) -> None:
        url = f"http://127.0.0.1:{ports[i % len(ports)]}/v1/chat/completions"
        barrier.wait()
        with httpx.stream(
            "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as response:
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert "retry-after" in response.headers
                assert response.headers["x-should-retry"] == "true"
            answered.wait(timeout=120)  # hold the stream open until all have answers

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return statuses
