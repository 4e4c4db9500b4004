"""The response store on SQLite and PostgreSQL: tenancy, events in order, leases, retention."""

from __future__ import annotations

from typing import Any

from sluice.storage.db import Database
from sluice.storage.responses import ResponseStore
from tests.integration.storage.stores import FakeClock

ITEMS = [{"id": "msg_in0", "type": "message", "role": "user", "content": "hi"}]


def body(response_id: str, status: str, created_at: int = 1_767_225_610) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "status": status, "created_at": created_at}


def event(seq: int, kind: str = "response.output_text.delta") -> dict[str, Any]:
    return {"type": kind, "sequence_number": seq, "delta": f"t{seq}"}


def seconds(clock: FakeClock) -> int:
    return clock() // 1000


def test_a_tenant_reads_only_its_own_responses(db: Database) -> None:
    store = ResponseStore(db)
    store.create(body("resp_a", "completed"), "tenant-a", ITEMS, background=False)
    stored = store.get("resp_a", "tenant-a")
    assert stored is not None and stored.finished and stored.input_items == ITEMS
    assert store.get("resp_a", "tenant-b") is None
    assert store.request_cancel("resp_a", "tenant-b") is None
    assert store.events_after("resp_a", "tenant-b", -1) == []
    assert not store.delete("resp_a", "tenant-b")
    assert store.get("resp_a", "tenant-a") is not None
    assert store.delete("resp_a", "tenant-a")
    assert store.get("resp_a", "tenant-a") is None


def test_events_replay_in_order_after_n_and_the_body_follows_the_writes(db: Database) -> None:
    store = ResponseStore(db)
    store.create(body("resp_b", "queued"), "t", ITEMS, background=True, owner="gw-1", lease_s=15)
    store.write("resp_b", body("resp_b", "in_progress"), [event(0, "response.created"), event(1)])
    store.write("resp_b", None, [event(2), event(3)])
    assert [e["sequence_number"] for e in store.events_after("resp_b", "t", -1)] == [0, 1, 2, 3]
    assert store.events_after("resp_b", "t", 1) == [event(2), event(3)]
    stored = store.get("resp_b", "t")
    assert stored is not None and stored.status == "in_progress" and not stored.finished
    store.write(
        "resp_b", body("resp_b", "completed"), [event(4, "response.completed")], finished=True
    )
    stored = store.get("resp_b", "t")
    assert stored is not None and stored.status == "completed"
    assert store.delete("resp_b", "t")
    assert store.events_after("resp_b", "t", -1) == []


def test_a_lapsed_lease_fails_the_response_with_a_last_event(db: Database) -> None:
    clock = FakeClock()
    store = ResponseStore(db, clock=lambda: seconds(clock))
    store.create(body("resp_c", "queued"), "t", ITEMS, background=True, owner="gw-1", lease_s=15)
    store.write("resp_c", body("resp_c", "in_progress"), [event(0, "response.created")])
    store.create(body("resp_d", "queued"), "t", ITEMS, background=True, owner="gw-2", lease_s=15)
    error = {"code": "server_error", "message": "its gateway stopped"}
    clock.advance(10)
    assert store.renew("gw-1", ["resp_c"], 15) == set()  # gw-1 lives on; gw-2 went silent
    clock.advance(10)
    assert store.fail_orphans(error) == ["resp_d"]
    failed = store.get("resp_d", "t")
    assert failed is not None and failed.status == "failed" and failed.body["error"] == error
    assert [e["type"] for e in store.events_after("resp_d", "t", -1)] == ["response.failed"]
    running = store.get("resp_c", "t")
    assert running is not None and running.status == "in_progress"
    clock.advance(20)
    assert store.fail_orphans(error) == ["resp_c"]
    last = store.events_after("resp_c", "t", 0)
    assert [(e["type"], e["sequence_number"]) for e in last] == [("response.failed", 1)]


def test_cancel_is_marked_for_the_running_gateway_and_not_on_a_finished_one(db: Database) -> None:
    store = ResponseStore(db)
    store.create(body("resp_e", "queued"), "t", ITEMS, background=True, owner="gw-1", lease_s=15)
    stored = store.request_cancel("resp_e", "t")
    assert stored is not None and stored.cancel_requested
    assert store.renew("gw-1", ["resp_e"], 15) == {"resp_e"}
    store.create(body("resp_f", "completed"), "t", ITEMS, background=True)
    stored = store.request_cancel("resp_f", "t")
    assert stored is not None and not stored.cancel_requested


def test_responses_past_the_retention_are_deleted(db: Database) -> None:
    clock = FakeClock()
    store = ResponseStore(db, clock=lambda: seconds(clock))
    now = seconds(clock)
    store.create(body("resp_old", "completed", now - 31 * 86_400), "t", ITEMS, background=True)
    store.write("resp_old", None, [event(0)])
    store.create(body("resp_new", "completed", now - 86_400), "t", ITEMS, background=False)
    assert store.delete_expired(30 * 86_400) == 1
    assert store.get("resp_old", "t") is None
    assert store.events_after("resp_old", "t", -1) == []
    assert store.get("resp_new", "t") is not None
