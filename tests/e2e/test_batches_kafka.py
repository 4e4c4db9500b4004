"""The Batch API in distributed mode: `sluice up` with two engine workers on Kafka,
PostgreSQL and Redis (the Celery broker), so the batches worker and its beat run as
processes of their own; driven by the official openai SDK.

A batch's output equals each of its requests sent alone; a kill -9 of the batches worker
and of the engine worker running the batch, mid-batch, loses and repeats no line, and
bills every attempt once, at least what the output holds.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import sqlalchemy as sa

from benchmarks.faults import ADMIN_URL
from benchmarks.faults_infra import RedisServer, busiest
from sluice.bus.codec import decode_as
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC
from tests.e2e.batch_checks import (
    chat_line,
    check_each_once,
    jsonl,
    results,
    sdk_client,
    submit,
    unlike_alone,
    wait,
    wait_for_progress,
)
from tests.e2e.procs import SluiceProcess, UpStack, free_port, serving_args, wait_ready
from tests.services import service_missing
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

BATCHES_WORKER = "sluice worker batches( |$)"  # not batches-beat
ENGINE_WORKER = "sluice worker engine"
# enough work that the engine is still running lines when the kill lands a few waves in
KILL_LINES, KILL_TOKENS = 400, 128


@dataclass
class Fleet(UpStack):
    db_url: str

    def client(self) -> openai.OpenAI:
        return sdk_client(self.base)


def _as_admin(statement: str) -> None:
    """One statement on the local server's admin database, outside a transaction."""
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(statement))
    finally:
        admin.dispose()


def _scratch_database() -> tuple[str, str]:
    """A new empty database on the local server: (name, URL)."""
    name = f"sluice_batches_{uuid.uuid4().hex[:8]}"
    _as_admin(f'CREATE DATABASE "{name}"')
    return name, ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def _drop_database(name: str) -> None:
    _as_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def fleet(
    data_dir: Path, dedicated_kafka: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    try:
        sa.create_engine(ADMIN_URL).connect().close()
    except Exception as exc:
        service_missing(f"PostgreSQL at {ADMIN_URL}: {exc}")
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        service_missing("redis-server is not on PATH (the fleet's Celery broker)")
    name, db_url = _scratch_database()
    redis = RedisServer().start()  # a broker of its own: no other run's tasks in its queue
    env = {
        "SLUICE_KAFKA_BOOTSTRAP": dedicated_kafka,
        "SLUICE_REDIS_URL": f"redis://127.0.0.1:{redis.port}/0",
        "SLUICE_DATABASE_URL": db_url,
        "SLUICE_ENGINE_GROUP_ID": f"engine-batches-{uuid.uuid4().hex[:6]}",
        "SLUICE_BATCH_SWEEP_S": "2",
        "SLUICE_BATCH_RECOVER_S": "10",  # a killed step is rerun 10 s on
    }
    port = free_port()
    log = tmp_path_factory.mktemp("batches-up") / "up.log"
    proc = SluiceProcess([*serving_args("up", port, data_dir), "--engine-workers", "2"], log, env)
    try:
        subprocess.run(
            [sys.executable, "-m", "sluice", "migrate"],
            env={**proc.env},
            check=True,
            capture_output=True,
        )
        proc.start()
        fleet = Fleet(f"http://127.0.0.1:{port}", proc, dedicated_kafka, db_url)
        wait_ready(fleet.base, proc)
        _wait_for_workers(fleet)
        yield fleet
    finally:
        code = proc.stop() if proc.proc is not None else 0
        redis.stop()
        _drop_database(name)
    assert code == 0, proc.output()[-3000:]


def _wait_for_workers(fleet: Fleet) -> None:
    """Both engine workers answer, and the batches worker and beat run."""
    with fleet.client() as client:

        def up() -> bool:
            with contextlib.suppress(openai.APIError):
                client.chat.completions.create(
                    model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                running = [fleet.pids(p) for p in (ENGINE_WORKER, BATCHES_WORKER, "batches-beat")]
                return [len(p) for p in running] == [2, 1, 1]
            return False

        try:
            wait_until(up, 120, "the workers to come up", interval_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{fleet.proc.output()[-4000:]}") from None


def test_each_line_equals_its_request_sent_alone(fleet: Fleet) -> None:
    lines = [
        chat_line(f"line-{i}", f"tell me about {i} rivers", max_tokens=24, ignore_eos=True)
        for i in range(40)
    ]
    with fleet.client() as client:
        batch = wait(client, submit(client, jsonl(lines)).id, timeout_s=120)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None and batch.request_counts.completed == 40
        out, err = results(client, batch)
        assert not err
        assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
        differ = unlike_alone(client, lines, out)
    assert differ == []


def _usage_keys(bootstrap: str, batch_id: str, timeout_s: float = 60) -> set[tuple[str, int]]:
    """(request_id, attempt) of every engine usage record of the batch, read until quiet."""
    bus = KafkaEventBus(KafkaConfig(bootstrap=bootstrap, client_id="e2e-batch-usage"))
    consumer = bus.consumer(f"e2e-batch-usage-{uuid.uuid4().hex[:6]}", [USAGE_TOPIC])
    keys: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout_s
    quiet_until = time.monotonic() + 5.0
    try:
        while time.monotonic() < min(deadline, quiet_until):
            for record in consumer.poll(0.5):
                usage = decode_as(UsageRecord, record.value)
                if usage.batch_id == batch_id:
                    keys.add((usage.request_id, usage.attempt))
                    quiet_until = time.monotonic() + 3.0
    finally:
        consumer.close()
        bus.close()
    return keys


def _ledger(db_url: str, batch_id: str) -> list[tuple[str, int, int]]:
    """(request_id, attempt, completion tokens) of the batch's ledger rows."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT request_id, attempt, completion_tokens FROM usage_ledger "
                    "WHERE batch_id = :batch"
                ),
                {"batch": batch_id},
            ).all()
    finally:
        engine.dispose()
    return [(r[0], r[1], r[2]) for r in rows]


def test_kill_9_of_the_batches_worker_and_an_engine_worker_mid_batch(fleet: Fleet) -> None:
    lines = [
        chat_line(f"k{i}", f"poem number {i}", max_tokens=KILL_TOKENS, ignore_eos=True)
        for i in range(KILL_LINES)
    ]
    with fleet.client() as client:
        batch = submit(client, jsonl(lines))
        wait_for_progress(client, batch.id, 20)
        (batches_worker,) = fleet.pids(BATCHES_WORKER)
        engine_worker = busiest(fleet.pids(ENGINE_WORKER))
        for pid in (batches_worker, engine_worker):
            subprocess.run(["kill", "-9", str(pid)], check=True)
        before = client.batches.retrieve(batch.id).request_counts
        batch = wait(client, batch.id, timeout_s=150)
        assert batch.status == "completed", batch
        out, err = results(client, batch)
    assert before is not None and before.completed < len(lines), "the kill came after the end"
    check_each_once(lines, out, err)
    assert not err, err[:3]
    # `sluice up` started new ones in place of the killed
    assert fleet.pids(BATCHES_WORKER) != [batches_worker]
    assert engine_worker not in fleet.pids(ENGINE_WORKER)

    # money: one ledger row per attempt the engine reported, none twice, and each line
    # billed at least the tokens its output holds (a resumed line: every attempt's)
    engine_keys = _usage_keys(fleet.bootstrap, batch.id)
    resumed = sorted(k for k in engine_keys if k[1] >= 1)
    assert resumed, (
        f"no line was resumed (killed at {before}, pids {batches_worker}, {engine_worker})"
    )
    with contextlib.suppress(AssertionError):  # the asserts below say what differs
        wait_until(
            lambda: {(r, a) for r, a, _ in _ledger(fleet.db_url, batch.id)} == engine_keys,
            60,
            "the ledger",
            interval_s=0.5,
        )
    rows = _ledger(fleet.db_url, batch.id)
    assert len(rows) == len({(r, a) for r, a, _ in rows})
    assert {(r, a) for r, a, _ in rows} == engine_keys
    billed: dict[str, int] = {}
    for request_id, _, tokens in rows:
        billed[request_id] = billed.get(request_id, 0) + tokens
    delivered = {
        x["response"]["request_id"]: x["response"]["body"]["usage"]["completion_tokens"]
        for x in out
    }
    short = {rid: (billed.get(rid, 0), n) for rid, n in delivered.items() if billed.get(rid, 0) < n}
    assert short == {}
    assert sum(billed.values()) >= sum(delivered.values()) == KILL_TOKENS * len(lines)
