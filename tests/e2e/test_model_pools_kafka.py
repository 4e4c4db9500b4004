"""`sluice up` on Kafka with two model pools: `tiny-llama` with two engine workers and a
second model with none. The second pool's requests wait in its topics until a worker
starts, then every one completes (scale from zero behind the queue); a model with no pool
is a 404 at once; kill -9 of a `tiny-llama` worker mid-stream leaves the other pool's
streams untouched (one attempt each, the same text as before the kill)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from sluice.engine.preset import write_tiny_llama
from tests.e2e.procs import API_KEY, SluiceProcess, UpStack, free_port, serving_args, sluice_up
from tests.e2e.test_up_kafka import REDIS_URL, _usage_attempts
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

SECOND = "tiny-b"
TOKENS = 120


@dataclass
class Fleet(UpStack):
    env: dict[str, str]
    second: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base}/v1", api_key=API_KEY, max_retries=0, timeout=180
        )

    def worker_pids(self, model: str) -> list[int]:
        return self.pids(f"worker engine --model {model}")


@pytest.fixture(scope="module")
def fleet(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    second = tmp_path_factory.mktemp("models") / SECOND
    second.mkdir()
    write_tiny_llama(second, seed=1)
    log = tmp_path_factory.mktemp("pools") / "up.log"
    args = [
        *serving_args("up", free_port(), data_dir),
        *("--model", "tiny-llama", "--model", str(second)),
        *("--pool", "tiny-llama=2", "--pool", f"{SECOND}=0"),
    ]
    env = {
        "SLUICE_REDIS_URL": REDIS_URL,
        "SLUICE_ENGINE_GROUP_ID": f"engine-pools-{uuid.uuid4().hex[:6]}",
    }
    with sluice_up(args, log, env, REDIS_URL) as up:
        yield Fleet(up.base, up.proc, up.bootstrap, env, second)


def _stream(client: openai.OpenAI, model: str, prompt: str, out: dict, ids: list[str]) -> None:
    sent = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ids.append(raw.headers["x-request-id"])
    text, finish, first = "", "", None
    for chunk in raw.parse():
        for choice in chunk.choices:
            if choice.delta.content and first is None:
                first = time.monotonic() - sent
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    out[prompt] = (text, finish, first)


def _streams(fleet: Fleet, model: str, prompts: list[str], ids: list[str]) -> tuple[dict, list]:
    out: dict[str, tuple[str, str, float | None]] = {}
    client = fleet.client()
    threads = [
        threading.Thread(target=_stream, args=(client, model, p, out, ids), daemon=True)
        for p in prompts
    ]
    for thread in threads:
        thread.start()
    return out, threads


def test_a_pool_at_zero_waits_then_serves_every_request(fleet: Fleet, tmp_path: Path) -> None:
    with fleet.client() as client:
        models = {m.id for m in client.models.list().data}
        assert {"tiny-llama", SECOND} <= models
        started = time.monotonic()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert time.monotonic() - started < 2.0
    prompts = [f"Cold start {i}" for i in range(4)]
    out, threads = _streams(fleet, SECOND, prompts, [])
    time.sleep(4.0)
    assert not out, "a pool with no worker answered"
    worker = SluiceProcess(
        ["worker", "engine", "--model", str(fleet.second), "--data-dir", str(tmp_path)],
        tmp_path / "worker.log",
        {**fleet.env, "SLUICE_KAFKA_BOOTSTRAP": fleet.bootstrap},
    ).start()
    try:
        for thread in threads:
            thread.join(180)
        assert set(out) == set(prompts), worker.output()[-3000:]
        assert all(finish == "length" and first for _, finish, first in out.values()), out
    finally:
        worker.stop()


def test_killing_one_pools_worker_leaves_the_other_pool_untouched(fleet: Fleet) -> None:
    # the second pool runs on a worker of its own (`up` starts none for it)
    worker = SluiceProcess(
        ["worker", "engine", "--model", str(fleet.second)],
        fleet.proc.log.with_name("second-worker.log"),
        {**fleet.env, "SLUICE_KAFKA_BOOTSTRAP": fleet.bootstrap},
    ).start()
    try:
        prompts = [f"Pool story {i}" for i in range(6)]
        reference, threads = _streams(fleet, SECOND, prompts, [])
        for thread in threads:
            thread.join(180)
        assert len(reference) == len(prompts), worker.output()[-3000:]
        ids_b: list[str] = []
        ids_a: list[str] = []
        out_b, threads_b = _streams(fleet, SECOND, prompts, ids_b)
        out_a, threads_a = _streams(fleet, "tiny-llama", prompts, ids_a)
        wait_until(lambda: len(ids_a) == len(prompts), 60, "the tiny-llama streams started")
        time.sleep(0.5)
        victims = fleet.worker_pids("tiny-llama")
        assert len(victims) == 2, victims
        os.kill(victims[0], signal.SIGKILL)
        for thread in [*threads_a, *threads_b]:
            thread.join(240)
        assert set(out_a) == set(prompts), "tiny-llama streams lost"
        assert all(finish == "length" for _, finish, _ in out_a.values()), out_a
        # the other pool: the same answers as before the kill, each from its first attempt
        assert {p: out_b[p][:2] for p in prompts} == {p: reference[p][:2] for p in prompts}
        usage = _usage_attempts(fleet.bootstrap, set(ids_b))
        assert all(set(per_attempt) == {0} for per_attempt in usage.values()), usage
    finally:
        worker.stop()
