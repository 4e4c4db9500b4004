"""The money suite on Kafka: a `sluice up` fleet (gateway, two engine workers, billing
and quotas; `benchmarks.faults_infra`) with plain requests, a kill -9 of the engine
worker running the streams, and a kill -9 of the gateway mid-stream.

PostgreSQL is the one at $SLUICE_TEST_DATABASE_URL (a scratch database for the run).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.faults import create_database, drop_database, kill_gateway, kill_worker
from benchmarks.faults_infra import Fleet
from benchmarks.money import Row, Seen, failed_row, wanted
from benchmarks.money_clients import ADMIN_KEY, Admin, call, chat_body, completion_body, sdk
from benchmarks.money_clients import wait_until as wait_async
from benchmarks.money_serve import mixed_bodies, requests_under

# a failover waits out the dead worker's Kafka session, then the resumed streams finish
STREAM_TIMEOUT_S = 150.0
SETTLE_S = 90.0  # usage records of a killed worker's requests come from the resumer


def plain(fleet: Fleet, admin: Admin, quick: bool) -> list[Row]:
    bodies = mixed_bodies(random.Random(4), 8 if quick else 24)
    tenant, seen = requests_under(fleet.base_url, admin, "fleet-plain", bodies)
    return [admin.settle("plain chat + completions (Kafka fleet)", tenant, seen, SETTLE_S)]


def _killed_mid_stream(
    fleet: Fleet,
    admin: Admin,
    scenario: str,
    kill: Callable[[Fleet], str],
    max_tokens: int = 300,
) -> list[Row]:
    """Streams under a tenant of their own; `kill` once each has some tokens."""
    tenant = admin.tenant(kill.__name__.replace("_", "-"))
    greedy = {"stream": True, "extra_body": {"ignore_eos": True}}
    bodies = [chat_body(f"Failover story {i}", max_tokens, **greedy) for i in range(4)]
    bodies += [completion_body(f"Failover story {i}", max_tokens, **greedy) for i in range(4, 8)]
    seen = [Seen() for _ in bodies]
    injected: list[str] = []

    async def go() -> None:
        async with sdk(fleet.base_url, tenant.api_key, STREAM_TIMEOUT_S) as client:
            pairs = zip(bodies, seen, strict=True)
            tasks = [asyncio.create_task(call(client, b, s)) for b, s in pairs]
            await wait_async(lambda: all(s.received >= 3 for s in seen), "every stream to start")
            injected.append(await asyncio.to_thread(kill, fleet))
            await asyncio.gather(*tasks)

    asyncio.run(go())
    recovered(fleet)
    row = admin.settle(scenario, tenant, seen, SETTLE_S)
    row.notes.insert(0, "; ".join(injected))
    return [row]


def recovered(fleet: Fleet, timeout_s: float = 120.0) -> None:
    """Until `sluice up` restarted what was killed: the gateway ready, every engine worker
    ready (its engine loaded, partitions held). Raises naming what is still missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = _missing(fleet)
        if missing is None:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the fleet did not recover in {timeout_s:.0f}s: {missing}")
        time.sleep(0.5)


def _missing(fleet: Fleet) -> str | None:
    try:
        ready = httpx.get(f"{fleet.base_url}/readyz", timeout=2)
    except httpx.HTTPError as exc:
        return f"gateway: {exc!r}"
    if ready.status_code != 200:
        return f"gateway /readyz {ready.status_code}: {ready.text[:200]}"
    workers = fleet.worker_pids()
    if len(workers) != fleet.engine_workers:
        return f"engine workers {workers}"
    not_ready = [pid for pid in workers if not fleet.worker_ready(pid)]
    return f"engine workers not ready: {not_ready}" if not_ready else None


def worker_kill(fleet: Fleet, admin: Admin, quick: bool) -> list[Row]:
    return _killed_mid_stream(fleet, admin, "kill -9 of the worker mid-stream", kill_worker)


def gateway_kill(fleet: Fleet, admin: Admin, quick: bool) -> list[Row]:
    # streams far longer than the gateway's ttl: its requests are cancelled once workers
    # miss its heartbeats (billed for what ran until then), not run to max_tokens
    scenario = "kill -9 of the gateway mid-stream"
    return _killed_mid_stream(fleet, admin, scenario, kill_gateway, max_tokens=1500)


SCENARIOS: list[tuple[str, Callable[[Fleet, Admin, bool], list[Row]]]] = [
    ("fleet plain", plain),
    ("worker kill", worker_kill),
    ("gateway kill", gateway_kill),
]


def run(workdir: Path, quick: bool, only: list[str] | None) -> list[dict[str, Any]]:
    todo = [(name, scenario) for name, scenario in SCENARIOS if wanted(name, only)]
    if not todo:
        return []
    db_name = f"sluice_money_{uuid.uuid4().hex[:8]}"
    fleet = Fleet(workdir, create_database(db_name), env={"SLUICE_ADMIN_KEY": ADMIN_KEY})
    rows: list[dict[str, Any]] = []
    try:
        fleet.start()
        admin = Admin(fleet.base_url, fleet.database_url)
        admin.set_price()
        for name, scenario in todo:
            started = time.monotonic()
            try:
                for row in scenario(fleet, admin, quick):
                    row.seconds = time.monotonic() - started
                    rows.append(row.as_dict())
            except Exception as exc:  # a scenario that breaks is a row, the others still run
                rows.append(failed_row(name, exc, time.monotonic() - started))
    finally:
        fleet.stop()
        drop_database(db_name)
    return rows
