"""Stored and background responses through the `openai` SDK, on SQLite and PostgreSQL.

The whole flow in one process (`tests/integration/billing/gateway_stack.py`): a gateway
with its tenant store, the engine worker on the deterministic fake backend, the billing
consumer writing the ledger. What a tenant relies on: a background response is polled
to completion; its events replay from `starting_after` as first numbered; a cancel mid-run
ends it `cancelled` with the usage the ledger bills; another tenant gets 404 for all of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from sluice.api.stored_responses import SHUT_DOWN
from sluice.billing import admin
from sluice.storage.db import Database
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.responses import ResponseStore
from sluice.storage.tables import UsageEntry
from tests.integration.billing.gateway_stack import MODEL, Stack, start_stack
from tests.sse import Events, read_events
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(db: Database) -> Iterator[Stack]:
    admin.set_price(db, MODEL, input_usd="1", cached_input_usd="0.5", output_usd="2")
    running = start_stack(db, MemoryQuotaStore)
    try:
        yield running
    finally:
        running.close()


def client(stack: Stack, tenant: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key=tenant["api_key"], timeout=30)


def ledger(db: Database, response_id: str) -> tuple[int, int] | None:
    """(prompt, completion) tokens billed for the response's request, once recorded."""
    request_id = "req_" + response_id.removeprefix("resp_")
    with db.session() as session:
        rows = session.scalars(sa.select(UsageEntry).where(UsageEntry.request_id == request_id))
        found = [(r.prompt_tokens, r.completion_tokens) for r in rows]
    if not found:
        return None
    return sum(p for p, _ in found), sum(c for _, c in found)


def finished(sdk: openai.OpenAI, response_id: str) -> Any:
    seen: dict[str, Any] = {}

    def done() -> bool:
        seen["r"] = sdk.responses.retrieve(response_id)
        return seen["r"].status not in ("queued", "in_progress")

    wait_until(done, 30, f"{response_id} to finish")
    return seen["r"]


def test_background_response_polled_replayed_continued_and_private(
    stack: Stack, db: Database
) -> None:
    a, b = admin.create_tenant(db, "tenant-a"), admin.create_tenant(db, "tenant-b")
    sdk, other = client(stack, a), client(stack, b)
    created = sdk.responses.create(
        model=MODEL, input="count", max_output_tokens=8, background=True, temperature=0
    )
    assert created.status == "queued" and created.background
    done = finished(sdk, created.id)
    assert done.status == "incomplete" and len(done.output_text) == 8
    assert done.usage is not None and done.usage.output_tokens == 8
    wait_until(lambda: ledger(db, done.id) is not None, 20, "the ledger row")
    assert ledger(db, done.id) == (done.usage.input_tokens, done.usage.output_tokens)

    events = list(sdk.responses.retrieve(created.id, stream=True))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    replay = list(sdk.responses.retrieve(created.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[5:]]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text

    follow_up = sdk.responses.create(
        model=MODEL, input="again", previous_response_id=done.id, max_output_tokens=4
    )
    assert follow_up.previous_response_id == done.id and follow_up.store
    assert follow_up.usage is not None
    assert follow_up.usage.input_tokens > done.usage.input_tokens  # it saw the conversation
    items = sdk.responses.input_items.list(follow_up.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in items.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    page = sdk.responses.input_items.list(follow_up.id, limit=2)
    assert len(page.data) == 2 and page.has_more
    rest = sdk.responses.input_items.list(follow_up.id, limit=2, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[0].id] and not rest.has_more

    for call in (
        lambda: other.responses.retrieve(done.id),
        lambda: list(other.responses.retrieve(done.id, stream=True)),
        lambda: other.responses.cancel(done.id),
        lambda: other.responses.delete(done.id),
        lambda: other.responses.input_items.list(done.id),
        lambda: other.responses.create(model=MODEL, input="x", previous_response_id=done.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "not_found"

    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(done.id)  # finished: nothing to cancel
    sdk.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(done.id)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=MODEL, input="x", background=True, store=False)
    assert refused.value.param == "store"


def test_background_response_cancelled_mid_run_bills_what_it_shows(
    stack: Stack, db: Database
) -> None:
    sdk = client(stack, admin.create_tenant(db, "tenant-a"))
    created = sdk.responses.create(
        model=MODEL, input="count", max_output_tokens=4000, background=True
    )
    stream = sdk.responses.retrieve(created.id, stream=True)
    deltas = 0
    for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas == 3:
            break
    cancelled = sdk.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    rest = list(stream)
    assert rest[-1].type == "response.cancelled"
    assert rest[-1].response == cancelled.to_dict()  # an event type the SDK does not model
    assert cancelled.usage is not None and 3 <= cancelled.usage.output_tokens < 4000
    assert len(cancelled.output_text) == cancelled.usage.output_tokens  # a letter a token
    assert sdk.responses.retrieve(created.id).model_dump() == cancelled.model_dump()
    wait_until(lambda: ledger(db, created.id) is not None, 20, "the ledger row")
    assert ledger(db, created.id) == (cancelled.usage.input_tokens, cancelled.usage.output_tokens)


def test_a_gateway_shutting_down_fails_its_running_responses(stack: Stack, db: Database) -> None:
    tenant = admin.create_tenant(db, "tenant-a")
    sdk = client(stack, tenant)
    stack.backend.gate.clear()  # the response stays in progress
    created = sdk.responses.create(model=MODEL, input="count", background=True)
    stack.servers[0].__exit__(None, None, None)  # the app's shutdown
    stack.servers.clear()
    stored = ResponseStore(db).get(created.id, tenant["tenant_id"])
    assert stored is not None and stored.status == "failed"
    assert stored.body["error"]["message"] == SHUT_DOWN
    events = ResponseStore(db).events_after(created.id, tenant["tenant_id"], -1)
    assert events[-1]["type"] == "response.failed"


def test_another_gateway_on_the_database_follows_and_cancels(db: Database) -> None:
    admin.set_price(db, MODEL, input_usd="1", cached_input_usd="0.5", output_usd="2")
    fleet = start_stack(db, MemoryQuotaStore, gateways=2)
    try:
        tenant = admin.create_tenant(db, "tenant-a")
        runs = client(fleet, tenant)
        other = openai.OpenAI(base_url=f"{fleet.urls[1]}/v1", api_key=tenant["api_key"], timeout=30)
        created = runs.responses.create(
            model=MODEL, input="count", max_output_tokens=4000, background=True
        )
        stream = other.responses.retrieve(created.id, stream=True, starting_after=1)
        first = next(iter(stream))
        assert first.sequence_number == 2
        cancelled = other.responses.cancel(created.id)  # the running gateway's sweep acts
        assert cancelled.status == "cancelled"
        assert cancelled.usage is not None and cancelled.usage.output_tokens < 4000
        assert list(stream)[-1].type == "response.cancelled"
        wait_until(lambda: ledger(db, created.id) is not None, 20, "the ledger row")
        assert ledger(db, created.id) == (
            cancelled.usage.input_tokens,
            cancelled.usage.output_tokens,
        )
    finally:
        fleet.close()


# -- a streamed stored response resumes with Last-Event-ID -------------------------------
def _post_stream(
    stack: Stack,
    api_key: str,
    body: dict[str, Any],
    stop_after: int | None = None,
    last_event_id: str | None = None,
) -> Events:
    headers = {"Authorization": f"Bearer {api_key}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    events: Events = []
    url = f"{stack.urls[0]}/v1/responses"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        read_events(r.iter_lines(), events, stop_after)
    return events


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_stored_stream_dropped_and_resumed_equals_an_uninterrupted_run(db: Database) -> None:
    admin.set_price(db, MODEL, input_usd="1", cached_input_usd="0.5", output_usd="2")
    stack = start_stack(db, MemoryQuotaStore, stream_resume_window_s=30.0)
    try:
        tenant = admin.create_tenant(db, "tenant-a")
        sdk = client(stack, tenant)
        reference = sdk.responses.create(
            model=MODEL, input="count", max_output_tokens=120, temperature=0, stream=True
        )
        want = "".join(e.delta for e in reference if e.type == "response.output_text.delta")
        assert len(want) == 120

        body = {
            "model": MODEL, "input": "count", "max_output_tokens": 120, "temperature": 0,
            "stream": True,
        }  # fmt: skip
        first = _post_stream(stack, tenant["api_key"], body, stop_after=8)
        last_id = first[-1][0]
        assert last_id is not None and last_id.startswith("resp_")
        other = admin.create_tenant(db, "tenant-b")["api_key"]
        headers = {"Authorization": f"Bearer {other}", "Last-Event-ID": last_id}
        url = f"{stack.urls[0]}/v1/responses"
        assert httpx.post(url, json=body, headers=headers).status_code == 404
        headers["Authorization"] = f"Bearer {tenant['api_key']}"
        changed = {**body, "input": "other"}
        assert httpx.post(url, json=changed, headers=headers).status_code == 400

        rest = _post_stream(stack, tenant["api_key"], body, last_event_id=last_id)
        events = [json.loads(data) for _, data in first + rest]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert _text(events) == want
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.incomplete"
        response_id = final["id"]
        stored = sdk.responses.retrieve(response_id)
        assert stored.status == "incomplete" and stored.output_text == want
        usage = final["usage"]
        assert usage["output_tokens"] == 120
        wait_until(lambda: ledger(db, response_id) is not None, 20, "the ledger row")
        assert ledger(db, response_id) == (usage["input_tokens"], usage["output_tokens"])
        with db.session() as session:
            rows = session.scalars(
                sa.select(UsageEntry).where(
                    UsageEntry.request_id == "req_" + response_id.removeprefix("resp_")
                )
            ).all()
        assert len(rows) == 1  # billed once
    finally:
        stack.close()


def test_a_stored_stream_not_resumed_within_the_window_is_cancelled(
    stack: Stack, db: Database
) -> None:
    tenant = admin.create_tenant(db, "tenant-a")  # the stack's window is short
    sdk = client(stack, tenant)
    body = {"model": MODEL, "input": "count", "max_output_tokens": 4000, "stream": True}
    first = _post_stream(stack, tenant["api_key"], body, stop_after=8)
    response_id = json.loads(first[0][1])["response"]["id"]
    done = finished(sdk, response_id)
    assert done.status == "cancelled"
    assert done.usage is not None and done.usage.output_tokens < 4000
    assert len(done.output_text) == done.usage.output_tokens  # a letter a token
    wait_until(lambda: ledger(db, response_id) is not None, 20, "the ledger row")
    assert ledger(db, response_id) == (done.usage.input_tokens, done.usage.output_tokens)
    headers = {"Authorization": f"Bearer {tenant['api_key']}", "Last-Event-ID": first[-1][0]}
    r = httpx.post(f"{stack.urls[0]}/v1/responses", json=body, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"


def test_a_stored_response_not_streamed_is_kept_as_before(stack: Stack, db: Database) -> None:
    sdk = client(stack, admin.create_tenant(db, "tenant-a"))
    created = sdk.responses.create(model=MODEL, input="count", max_output_tokens=6)
    assert created.status == "incomplete" and len(created.output_text) == 6
    assert sdk.responses.retrieve(created.id).model_dump() == created.model_dump()
