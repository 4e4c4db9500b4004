"""Billing and quotas consumers: the usage topic replayed twice changes nothing."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
import sqlalchemy as sa

from sluice.billing.admission import UsageSettler
from sluice.bus.base import EventBus, TopicSpec
from sluice.bus.codec import encode
from sluice.bus.messages import UsageRecord
from sluice.consumers.billing import BillingHandler, billing_loop
from sluice.consumers.loop import ConsumeLoop
from sluice.consumers.quotas import quotas_loop
from sluice.storage.db import Database
from sluice.storage.ledger import UsageLedger
from sluice.storage.prices import Price, PriceBook, PriceCache
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.quotas import Reservation
from sluice.storage.tables import UsageEntry
from sluice.storage.tenants import PlanLimits
from tests.integration.billing.usage_data import make_usages
from tests.waiting import wait_until

SETTLE_S = 60.0


def set_prices(db: Database) -> None:
    book = PriceBook(db)
    book.set("llama-small", input_usd="0.15", cached_input_usd="0.075", output_usd="0.6",
             batch_discount="0.5")  # fmt: skip
    book.set("llama-large", input_usd="2.5", cached_input_usd="1.25", output_usd="10")


def ledger_snapshot(db: Database) -> list[tuple[object, ...]]:
    with db.session() as session:
        rows = session.execute(
            sa.select(UsageEntry).order_by(UsageEntry.request_id, UsageEntry.attempt)
        ).scalars()
        return [
            (r.request_id, r.attempt, r.tenant_id, r.prompt_tokens, r.cached_tokens,
             r.completion_tokens, r.cost_picos, r.priced, r.usage_day)
            for r in rows
        ]  # fmt: skip


def drain(loop: ConsumeLoop, expected: int) -> None:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        done = lambda: loop.stats.handled + loop.stats.dead_lettered >= expected  # noqa: E731
        wait_until(done, SETTLE_S, f"{expected} handled")
    finally:
        loop.stop()
        thread.join(30)
    assert loop.stats.dead_lettered == 0


def publish(bus: EventBus, topic: str, usages: list[UsageRecord]) -> None:
    bus.create_topics([TopicSpec(topic, 3), TopicSpec(f"{topic}.dlq", 1)])
    for usage in usages:
        bus.publish(topic, encode(usage), key=usage.tenant_id.encode())
    bus.flush()


def test_ledger_prices_at_write_and_ignores_duplicates(db: Database) -> None:
    set_prices(db)
    usages = make_usages(40)
    ledger = UsageLedger(db)
    assert ledger.record(usages) == len({(u.request_id, u.attempt) for u in usages})
    before = ledger_snapshot(db)
    assert ledger.record(usages) == 0
    assert ledger.record(list(reversed(usages[:10]))) == 0
    assert ledger_snapshot(db) == before
    small = Price("llama-small", 150_000, 75_000, 600_000, 5000)
    by_id = {row[0]: row for row in before}
    for u in usages:
        row = by_id[u.request_id]
        if u.model == "llama-small":
            batch = u.batch_id is not None
            want = small.cost_picos(
                u.prompt_tokens, u.cached_tokens, u.completion_tokens, batch=batch
            )
            assert row[6] == want and row[7] is True
        if u.model == "unpriced-model":
            assert (row[6], row[7]) == (0, False)
    # $0.15/M input, 100 tokens, no cache = 15 micro-dollars = 15e6 pico-dollars exactly
    assert small.cost_picos(100, 0, 0, batch=False) == 15_000_000
    assert Decimal(small.cost_picos(1, 0, 1, batch=True)) == Decimal(375_000)


def test_an_attempts_own_usage_replaces_the_resumers_estimate_in_either_order(
    db: Database,
) -> None:
    """A killed attempt's usage: the resuming worker's estimate (the tokens confirmed
    published) and the attempt's own record (what it generated, published before the
    kill) may both arrive, in either order; the ledger keeps the own one
    (docs/architecture.md §5.4)."""
    set_prices(db)
    ledger = UsageLedger(db)
    base = make_usages(2)
    own = [u.model_copy(update={"model": "llama-small", "completion_tokens": 200}) for u in base]
    estimate = [
        u.model_copy(update={"completion_tokens": 199, "estimated": True, "finish_reason": "error"})
        for u in own
    ]
    assert ledger.record([estimate[0]]) == 1
    assert ledger.record([estimate[0]]) == 0  # a replayed estimate
    assert ledger.record([own[0]]) == 1  # replaces it
    assert ledger.record([estimate[0], own[0]]) == 0  # replays change nothing now
    assert ledger.record([own[1]]) == 1
    assert ledger.record([estimate[1]]) == 0  # too late: the own record stays
    with db.session() as session:
        rows = session.execute(sa.select(UsageEntry).order_by(UsageEntry.request_id)).scalars()
        got = [(r.completion_tokens, r.finish_reason, r.estimated) for r in rows]
    assert got == [(200, own[0].finish_reason, False), (200, own[1].finish_reason, False)]
    # both in one batch: the own one wins there too
    third = own[0].model_copy(update={"request_id": "req-batch"})
    guess = estimate[0].model_copy(update={"request_id": "req-batch"})
    assert ledger.record([guess, third, guess]) == 1
    cost = {row[0]: row[6] for row in ledger_snapshot(db)}
    assert cost["req-batch"] == cost[own[0].request_id]


@pytest.mark.parametrize(
    "bus_kind,db_kind",
    [
        ("memory", "sqlite"),
        ("memory", "postgresql"),
        pytest.param("kafka", "postgresql", marks=[pytest.mark.kafka, pytest.mark.slow]),
    ],
)
def test_usage_topic_replayed_twice_leaves_the_ledger_unchanged(
    request: pytest.FixtureRequest, bus_kind: str, db_kind: str, topic: str, group: str
) -> None:
    bus = _bus(request, bus_kind)
    db = _db(request, db_kind)
    set_prices(db)
    usages = make_usages(60)
    usages += usages[:15]  # at-least-once: some records arrive twice in the topic itself
    publish(bus, topic, usages)
    snapshots = []
    for run in range(3):  # first delivery, then two full replays by fresh groups
        loop = billing_loop(bus, UsageLedger(db), group_id=f"{group}-{run}", topic=topic)
        drain(loop, len(usages))
        handler = loop.handler
        assert isinstance(handler, BillingHandler)
        assert handler.inserted == (60 if run == 0 else 0)
        snapshots.append(ledger_snapshot(db))
    assert len(snapshots[0]) == 60
    assert snapshots[0] == snapshots[1] == snapshots[2]


def test_quota_consumer_replays_count_once(db: Database, topic: str, group: str) -> None:
    from sluice.bus.memory import MemoryEventBus

    bus = MemoryEventBus()
    set_prices(db)
    usages = [u for u in make_usages(30) if u.tenant_id == "ten_a"]
    publish(bus, topic, usages + usages)
    store = MemoryQuotaStore()
    settler = UsageSettler(store, PriceCache(PriceBook(db)))
    for run in range(2):
        drain(quotas_loop(bus, settler, group_id=f"{group}-{run}", topic=topic), 2 * len(usages))
    spent = sum(settler.settlement(
        u.tenant_id, u.request_id, u.attempt, u.model,
        _usage(u), batch=u.batch_id is not None,
    ).cost_micros for u in usages)  # fmt: skip
    # exactly `spent` was counted once: a budget of spent + 1 leaves room for 1, not 2
    limits = PlanLimits(monthly_budget_micros=spent + 1)
    assert store.admit(limits, Reservation("ten_a", "x", 0, 1, 1)).allowed
    assert not store.admit(limits, Reservation("ten_a", "y", 0, 1, 1)).allowed
    bus.close()


def _usage(u: UsageRecord):  # type: ignore[no-untyped-def]
    from sluice.bus.messages import Usage

    return Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                 completion_tokens=u.completion_tokens)  # fmt: skip


def _bus(request: pytest.FixtureRequest, kind: str) -> EventBus:
    if kind == "memory":
        from sluice.bus.memory import MemoryEventBus

        bus = MemoryEventBus()
    else:
        from sluice.bus.kafka import KafkaConfig, KafkaEventBus

        bootstrap = request.getfixturevalue("kafka_bootstrap")
        bus = KafkaEventBus(KafkaConfig(bootstrap=bootstrap, client_id="sluice-test"))
    request.addfinalizer(bus.close)
    return bus


def _db(request: pytest.FixtureRequest, kind: str) -> Database:
    from pathlib import Path

    from sluice.storage.db import make_engine, migrate
    from tests.integration.storage.stores import empty

    if kind == "postgresql":
        pg: Database = request.getfixturevalue("pg_database")
        empty(pg)
        return pg
    tmp: Path = request.getfixturevalue("tmp_path")
    engine = make_engine(f"sqlite:///{tmp / 'sluice.db'}")
    migrate(engine)
    database = Database(engine)
    request.addfinalizer(database.close)
    return database
