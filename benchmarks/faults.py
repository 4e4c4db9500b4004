"""`sluice bench faults`: what the pipeline survives, one row per fault.

Each row runs `total` mixed requests (streams, unary completions, streams the client
hangs up on), and more while its fault is still being injected, against a fresh `sluice
up` fleet (gateway, two engine workers, billing and quotas consumers) on Kafka (Tansu),
Redis and PostgreSQL, each reached through a TCP proxy, and injects its fault while the
requests run. It reports, per row:

- the clients' side (`benchmarks.faults_load`): sent, completed, cancelled, failed with
  a clear error, lost, duplicated and missing tokens;
- money: Σ ledger rows against Σ engine usage records (one per request attempt, the
  attempt's own record over a resumer's estimate, as the ledger keeps them), read from
  the usage topic and from PostgreSQL once the billing consumer has caught up; and Σ
  ledger against Σ usage the clients were shown (`benchmarks.money`: a request whose
  client never got a usage object counts its own ledger rows, what `/v1/usage` shows it).

The goal for every row: 0 lost, 0 duplicated or missing tokens, ledger = engine usage =
the usage the clients were shown (docs/architecture.md §5.4); for
a graceful one (the rolling restart) also 0 failed and every completed request billed
exactly the completion tokens its client got.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks.faults_infra import API_KEY, Fleet, TcpProxy, busiest
from benchmarks.faults_load import Load, Outcome, run_load, summarize
from benchmarks.money import LedgerRow, Seen, Tally, client_visible
from sluice.bus.codec import decode_as
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC

ADMIN_URL = os.environ.get("SLUICE_TEST_DATABASE_URL",
                           "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")  # fmt: skip

Action = Callable[[Fleet], str]


def _kill(pid: int, what: str) -> str:
    os.kill(pid, signal.SIGKILL)
    return f"kill -9 {what} {pid}"


def kill_worker(fleet: Fleet) -> str:
    return _kill(busiest(fleet.worker_pids()), "engine worker")


def kill_engine_process(fleet: Fleet) -> str:
    return _kill(busiest(fleet.engine_process_pids()), "engine process")


def kill_gateway(fleet: Fleet) -> str:
    (victim,) = fleet.gateway_pids()
    return _kill(victim, "gateway")


def rolling_restart(fleet: Fleet) -> str:
    """SIGTERM each engine worker in turn, the next once the previous one's replacement is
    ready (engine loaded, partitions held). A worker drains (finishes what its engine
    holds, commits) and exits; `sluice up` then starts its replacement: after the exit,
    not before, so the others carry the load meanwhile."""
    old = fleet.worker_pids()
    if len(old) < 2:
        raise RuntimeError(f"a rolling restart needs >= 2 engine workers, found {old}")
    steps, known = [], set(old)
    for pid in old:
        started = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        _wait_for(lambda pid=pid: pid not in fleet.worker_pids(), f"worker {pid} to exit")
        drained_s = time.monotonic() - started
        new = _wait_for(lambda: _started_since(fleet, known), f"a replacement for {pid}")
        known.add(new)
        _wait_for(lambda new=new: fleet.worker_ready(new), f"replacement {new} to be ready")
        steps.append(f"{pid} drained in {drained_s:.1f}s, {new} ready after "
                     f"{time.monotonic() - started:.1f}s")  # fmt: skip
    now = fleet.worker_pids()
    if len(now) != len(old) or set(now) & set(old):
        raise RuntimeError(f"after the rolling restart the workers are {now}, were {old}")
    return "rolling restart (SIGTERM): " + "; ".join(steps)


def _started_since(fleet: Fleet, known: set[int]) -> int | None:
    """An engine worker whose pid is not in `known`: a replacement."""
    return next((pid for pid in fleet.worker_pids() if pid not in known), None)


def _wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 180.0) -> Any:
    """Poll `condition` until it is truthy; its value. Raises past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")


def _outage(proxy: TcpProxy | None, down_s: float, what: str) -> str:
    """Connections to the service reset and new ones refused for `down_s`."""
    assert proxy is not None
    proxy.cut()
    time.sleep(down_s)
    proxy.restore()
    return f"{what} cut for {down_s:.0f}s"


def kafka_outage(fleet: Fleet) -> str:
    return _outage(fleet.kafka, 10.0, "Kafka")


def postgres_outage(fleet: Fleet) -> str:
    return _outage(fleet.pg_proxy, 5.0, "PostgreSQL")


BROKER_DOWN_S = 2.0


def broker_restart(fleet: Fleet) -> str:
    """kill -9 the Tansu broker and start it again on the same storage and port, after
    BROKER_DOWN_S in which every connection to it fails."""
    assert fleet.broker is not None and fleet.s3 is not None, "needs a durable fleet"
    victim = fleet.broker.pid
    fleet.broker.kill()
    time.sleep(BROKER_DOWN_S)
    started = time.monotonic()
    fleet.broker.start()
    return (f"kill -9 Tansu broker {victim}, restarted on {fleet.broker.storage} after "
            f"{BROKER_DOWN_S:.0f} s (listening in {time.monotonic() - started:.1f} s)")  # fmt: skip


def redis_restart(fleet: Fleet) -> str:
    assert fleet.redis is not None
    fleet.redis.restart(down_s=2.0)
    return "Redis restarted (2 s down, data lost)"


@dataclass(frozen=True)
class Fault:
    name: str
    actions: tuple[tuple[float, Action], ...]  # (fraction of requests done, action)
    # a graceful fault fails nothing and redoes nothing: every request completes (or its
    # client hangs up), each billed exactly the tokens its client got (a kill -9's resumed
    # attempt may regenerate a few, and bill them)
    graceful: bool = False
    durable: bool = False  # the broker keeps its data on disk (an s3rver bucket), not memory


FAULTS = [
    Fault("none", ()),
    Fault("3 worker kills + 1 engine process kill",
          ((0.2, kill_worker), (0.4, kill_worker), (0.6, kill_worker),
           (0.8, kill_engine_process))),
    Fault("Kafka outage 10 s", ((0.3, kafka_outage),)),
    Fault("Redis restart", ((0.3, redis_restart),)),
    Fault("PostgreSQL outage while billing writes", ((0.3, postgres_outage),)),
    Fault("gateway kill -9 mid-stream", ((0.4, kill_gateway),)),
    Fault("rolling restart (SIGTERM each engine worker in turn)", ((0.1, rolling_restart),),
          graceful=True),
    Fault("broker kill -9 and restart (durable storage)", ((0.3, broker_restart),),
          durable=True),
]  # fmt: skip


def run(
    total: int = 1000,
    max_tokens: int = 16,
    only: list[str] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    rows = []
    for fault in FAULTS:
        if only and not any(o.lower() in fault.name.lower() for o in only):
            continue
        rows.append(run_fault(fault, total, max_tokens, workdir))
    return {"total": total, "max_tokens": max_tokens, "rows": rows}


def run_fault(fault: Fault, total: int, max_tokens: int, workdir: Path | None) -> dict[str, Any]:
    root = workdir or Path(tempfile.mkdtemp(prefix="sluice-faults-"))
    db_name = f"sluice_faults_{uuid.uuid4().hex[:8]}"
    db_url = create_database(db_name)
    fleet = Fleet(root / fault.name.split()[0].lower(), db_url, durable=fault.durable)
    try:
        fleet.start()
        load = Load(fleet.base_url, API_KEY, total=total, max_tokens=max_tokens)
        injected: list[str] = []
        injector = _Injector(fleet, fault, total, injected)
        seconds = run_load(load, injector.on_progress, injector.busy)
        injector.join()
        row = {"fault": fault.name, "injected": injected, "seconds": round(seconds, 1)}
        row.update(summarize(load.outcomes, max_tokens))
        settling = time.monotonic()
        row.update(_money(fleet, load.outcomes, db_url))
        row["settle_seconds"] = round(time.monotonic() - settling, 1)
        row["at_goal"] = _at_goal(row) and not (fault.graceful and _redone_or_failed(row))
        return row
    finally:
        fleet.stop()
        drop_database(db_name)


class _Injector:
    """Runs each action once its fraction of requests is done, one at a time, in order."""

    def __init__(self, fleet: Fleet, fault: Fault, total: int, log: list[str]) -> None:
        self._fleet, self._log = fleet, log
        self._pending = sorted(fault.actions, key=lambda a: a[0])
        self._total = total
        self._busy = threading.Lock()
        self._threads: list[threading.Thread] = []

    def on_progress(self, done: int) -> None:
        if not self._pending or done < self._pending[0][0] * self._total:
            return
        if not self._busy.acquire(blocking=False):
            return  # the previous action still runs (an outage)
        _, action = self._pending.pop(0)
        thread = threading.Thread(target=self._run, args=(action,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self, action: Action) -> None:
        try:
            self._log.append(action(self._fleet))
        except Exception as exc:  # a fault that could not be injected is reported, not hidden
            self._log.append(f"{action.__name__} failed: {exc!r}")
        finally:
            self._busy.release()

    def busy(self) -> bool:
        """An action is still to run or running: the load goes on past its `total`."""
        return bool(self._pending) or any(thread.is_alive() for thread in self._threads)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(120)
        if self._pending:
            self._log.append(f"{len(self._pending)} action(s) never ran: the load ended first")


READBACK_MAX_WAIT_MS = 1000


def _money(fleet: Fleet, outcomes: list[Outcome], db_url: str) -> dict[str, Any]:
    """Σ engine usage (per attempt) and Σ ledger for the run's requests, once they agree."""
    request_ids = {o.request_id for o in outcomes if o.request_id}
    deadline = time.monotonic() + 90
    engine: dict[tuple[str, int], UsageRecord] = {}
    bus = KafkaEventBus(KafkaConfig(bootstrap=fleet.kafka_bootstrap, client_id="faults-usage"))
    # it reads the usage topic from its start: on S3 storage a fetch reads every batch
    # after its offset from the store before it answers, so it gets a wait that allows it
    wait_ms = READBACK_MAX_WAIT_MS if fleet.durable else None
    consumer = bus.consumer(f"faults-usage-{uuid.uuid4().hex[:6]}", [USAGE_TOPIC],
                            max_wait_ms=wait_ms)  # fmt: skip
    try:
        ledger: dict[str, int] = {}
        while True:
            quiet_until = time.monotonic() + 3.0
            # both loops stop at the deadline: a stream of records that never goes quiet
            # (or a ledger that never agrees) ends as a mismatch in the row, not a hang
            while time.monotonic() < min(quiet_until, deadline):
                for record in consumer.poll(0.5):
                    usage = decode_as(UsageRecord, record.value)
                    if usage.request_id in request_ids:
                        key = (usage.request_id, usage.attempt)
                        kept = engine.get(key)
                        if kept is None or (kept.estimated and not usage.estimated):
                            engine[key] = usage
                            quiet_until = time.monotonic() + 3.0
            ledger = _ledger(db_url, request_ids)
            if ledger == _engine_totals(engine) or time.monotonic() > deadline:
                break
    finally:
        consumer.close()
        bus.close()
    totals = _engine_totals(engine)
    return {
        **_client_visible(db_url, outcomes),
        "engine_attempts": totals["attempts"],
        "engine_completion_tokens": totals["completion_tokens"],
        "ledger_rows": ledger["attempts"],
        "ledger_completion_tokens": ledger["completion_tokens"],
        "ledger_equals_engine": ledger == totals,
        "billed_not_delivered": _billed_not_delivered(engine, outcomes),
    }


def _client_visible(db_url: str, outcomes: list[Outcome]) -> dict[str, Any]:
    """Σ prompt and completion tokens the clients were shown against Σ ledger rows of
    their requests (the promise of `sluice bench money`)."""
    seen = [
        Seen(o.request_id, None if o.usage_tokens is None else {
            "prompt_tokens": o.usage_prompt_tokens or 0, "completion_tokens": o.usage_tokens},
            received=o.tokens)
        for o in outcomes
    ]  # fmt: skip
    rows = ledger_rows(db_url, {o.request_id for o in outcomes if o.request_id})
    client, _ = client_visible(seen, rows)
    ledger = sum((Tally(1, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.cost_picos)
                  for r in rows), Tally())  # fmt: skip
    return {
        "client_prompt_tokens": client.prompt_tokens,
        "client_completion_tokens": client.completion_tokens,
        "ledger_prompt_tokens": ledger.prompt_tokens,
        "client_equals_ledger": (client.prompt_tokens, client.completion_tokens)
        == (ledger.prompt_tokens, ledger.completion_tokens),
    }


def ledger_rows(db_url: str, request_ids: set[str]) -> list[LedgerRow]:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, "
                        "cost_picos FROM usage_ledger WHERE request_id = ANY(:ids)"),
                {"ids": list(request_ids)},
            ).all()  # fmt: skip
    finally:
        engine.dispose()
    return [LedgerRow(*row) for row in rows]


def _billed_not_delivered(
    engine: dict[tuple[str, int], UsageRecord], outcomes: list[Outcome]
) -> int:
    """Completed requests whose attempts were billed other completion tokens than their
    client received: a request run twice (a drained attempt redone from the start) shows
    here, though the ledger still equals the engine's records."""
    billed: dict[str, int] = {}
    for (request_id, _), usage in engine.items():
        billed[request_id] = billed.get(request_id, 0) + usage.completion_tokens
    completed = (o for o in outcomes if o.status == "completed")
    return sum(1 for o in completed if billed.get(o.request_id or "") != o.tokens)


def _engine_totals(engine: dict[tuple[str, int], UsageRecord]) -> dict[str, int]:
    return {
        "attempts": len(engine),
        "prompt_tokens": sum(u.prompt_tokens for u in engine.values()),
        "completion_tokens": sum(u.completion_tokens for u in engine.values()),
    }


def _ledger(db_url: str, request_ids: set[str]) -> dict[str, int]:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT count(*), coalesce(sum(prompt_tokens), 0), "
                    "coalesce(sum(completion_tokens), 0) FROM usage_ledger "
                    "WHERE request_id = ANY(:ids)"
                ),
                {"ids": list(request_ids)},
            ).one()
    finally:
        engine.dispose()
    return {"attempts": row[0], "prompt_tokens": row[1], "completion_tokens": row[2]}


def create_database(name: str) -> str:
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def drop_database(name: str) -> None:
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _at_goal(row: dict[str, Any]) -> bool:
    return (
        row["lost"] == 0
        and row["duplicated_tokens"] == 0
        and row["missing_tokens"] == 0
        and row["usage_mismatches"] == 0
        and row["ledger_equals_engine"]
        and row["client_equals_ledger"]
    )


def _redone_or_failed(row: dict[str, Any]) -> bool:
    return bool(row["failed_clear"] or row["billed_not_delivered"])


def render(result: dict[str, Any]) -> str:
    head = ("| fault | sent | completed | cancelled | failed (clear) | lost | dup tokens | "
            "missing tokens | ledger / engine completion tokens | client-visible / ledger "
            "prompt + completion tokens | at goal |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in result["rows"]:
        money = f"{r['ledger_completion_tokens']} / {r['engine_completion_tokens']}"
        shown = (f"{r['client_prompt_tokens']} + {r['client_completion_tokens']} / "
                 f"{r['ledger_prompt_tokens']} + {r['ledger_completion_tokens']}")  # fmt: skip
        lines.append(
            f"| {r['fault']} | {r['sent']} | {r['completed']} | {r['cancelled']} | "
            f"{r['failed_clear']} | {r['lost']} | {r['duplicated_tokens']} | "
            f"{r['missing_tokens']} | {money} | {shown} | {'yes' if r['at_goal'] else 'NO'} |"
        )
    for r in result["rows"]:
        lines.append(f"- {r['fault']} ({r['seconds']} s): {'; '.join(r['injected']) or '-'}")
        lines.append(f"  {r['engine_attempts']} attempts; {r['billed_not_delivered']} completed "
                     "requests billed other tokens than their client got")  # fmt: skip
        if r["errors"]:
            lines.append(f"  errors: {r['errors']}")
    return "\n".join(lines)
