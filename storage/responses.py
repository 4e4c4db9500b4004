"""The response store: stored responses of the Responses API and their stream events.

A stored response is readable from every gateway on the same database (fleet mode shares
PostgreSQL). A background response is written as it runs: its row holds the response
object as last written, and `response_events` every stream event numbered as first sent,
so a replay from `starting_after` returns exactly those events. The gateway running one
holds a lease on its row and renews it; a row whose lease lapsed (its gateway died) is
failed by any gateway's sweep (`fail_orphans`), so nothing stays `in_progress` forever.

Tenancy: every read a tenant can cause takes its `tenant_id`, and another tenant's
response reads as missing.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.tables import ResponseEventRow, ResponseRow

UNFINISHED = ("queued", "in_progress")


def now_s() -> int:
    return int(time.time())


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    tenant_id: str
    status: str
    background: bool
    body: dict[str, Any]  # the response object
    input_items: list[dict[str, Any]]
    created_at: int
    cancel_requested: bool

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED


def _info(row: ResponseRow) -> StoredResponse:
    return StoredResponse(
        row.id, row.tenant_id, row.status, row.background, dict(row.body),
        list(row.input_items), row.created_at, row.cancel_requested,
    )  # fmt: skip


class ResponseStore:
    def __init__(self, db: Database, clock: Callable[[], int] = now_s) -> None:
        self.db = db
        self._clock = clock

    def create(
        self,
        body: dict[str, Any],
        tenant_id: str,
        input_items: list[dict[str, Any]],
        *,
        background: bool,
        owner: str | None = None,
        lease_s: int = 0,
    ) -> None:
        """Store a new response (`body["id"]`); a background one leased to `owner`."""
        row = ResponseRow(
            id=body["id"],
            tenant_id=tenant_id,
            status=body["status"],
            background=background,
            body=body,
            input_items=input_items,
            created_at=body["created_at"],
            owner=owner,
            lease_until=self._clock() + lease_s if owner is not None else None,
            cancel_requested=False,
        )
        with self.db.session() as session:
            session.add(row)

    def get(self, response_id: str, tenant_id: str) -> StoredResponse | None:
        with self.db.session() as session:
            row = session.get(ResponseRow, response_id)
            if row is None or row.tenant_id != tenant_id:
                return None
            return _info(row)

    def write(
        self,
        response_id: str,
        body: dict[str, Any] | None,
        events: Sequence[dict[str, Any]] = (),
        *,
        finished: bool = False,
    ) -> None:
        """Append `events` (each with its `sequence_number`) and, with `body`, replace the
        response object and its status; `finished` also ends the lease."""
        values: dict[str, Any] = {}
        if body is not None:
            values = {"body": body, "status": body["status"]}
        if finished:
            values |= {"owner": None, "lease_until": None}
        with self.db.session() as session:
            if events:
                session.add_all(
                    ResponseEventRow(response_id=response_id, seq=e["sequence_number"], event=e)
                    for e in events
                )
            if values:
                session.execute(
                    sa.update(ResponseRow).where(ResponseRow.id == response_id).values(**values)
                )

    def events_after(self, response_id: str, tenant_id: str, after: int) -> list[dict[str, Any]]:
        """The stored events numbered above `after`, in order (none for a missing id)."""
        with self.db.session() as session:
            rows = session.scalars(
                sa.select(ResponseEventRow.event)
                .join(ResponseRow, ResponseRow.id == ResponseEventRow.response_id)
                .where(
                    ResponseEventRow.response_id == response_id,
                    ResponseRow.tenant_id == tenant_id,
                    ResponseEventRow.seq > after,
                )
                .order_by(ResponseEventRow.seq)
            )
            return [dict(e) for e in rows]

    def request_cancel(self, response_id: str, tenant_id: str) -> StoredResponse | None:
        """Mark an unfinished response for cancelling (its gateway acts on it); the
        response as it is now, None when missing."""
        with self.db.session() as session:
            session.execute(
                sa.update(ResponseRow)
                .where(
                    ResponseRow.id == response_id,
                    ResponseRow.tenant_id == tenant_id,
                    ResponseRow.status.in_(UNFINISHED),
                )
                .values(cancel_requested=True)
            )
            row = session.get(ResponseRow, response_id)
            if row is None or row.tenant_id != tenant_id:
                return None
            return _info(row)

    def delete(self, response_id: str, tenant_id: str) -> bool:
        with self.db.session() as session:
            session.execute(
                sa.delete(ResponseEventRow).where(ResponseEventRow.response_id == response_id)
            )
            result = session.execute(
                sa.delete(ResponseRow).where(
                    ResponseRow.id == response_id, ResponseRow.tenant_id == tenant_id
                )
            )
            return bool(getattr(result, "rowcount", 0))

    # -- the sweep ---------------------------------------------------------------------
    def renew(self, owner: str, response_ids: Sequence[str], lease_s: int) -> set[str]:
        """Extend `owner`'s leases on these running responses; the ids among them whose
        cancel was asked for (through any gateway)."""
        if not response_ids:
            return set()
        with self.db.session() as session:
            session.execute(
                sa.update(ResponseRow)
                .where(ResponseRow.id.in_(response_ids), ResponseRow.owner == owner)
                .values(lease_until=self._clock() + lease_s)
            )
            cancelled = session.scalars(
                sa.select(ResponseRow.id).where(
                    ResponseRow.id.in_(response_ids), ResponseRow.cancel_requested.is_(True)
                )
            )
            return set(cancelled)

    def fail_orphans(self, error: dict[str, Any]) -> list[str]:
        """Fail the unfinished responses whose lease lapsed (their gateway died): the
        object gets status "failed" and `error`, the stream a last `response.failed`."""
        failed = []
        with self.db.session() as session:
            rows = session.scalars(
                sa.select(ResponseRow)
                .where(
                    ResponseRow.status.in_(UNFINISHED),
                    ResponseRow.lease_until < self._clock(),
                )
                .with_for_update(skip_locked=True)
            ).all()
            for row in rows:
                body = copy.deepcopy(dict(row.body))
                body |= {"status": "failed", "error": error}
                last = session.scalar(
                    sa.select(sa.func.max(ResponseEventRow.seq)).where(
                        ResponseEventRow.response_id == row.id
                    )
                )
                seq = -1 if last is None else last
                event = {"type": "response.failed", "sequence_number": seq + 1, "response": body}
                session.add(ResponseEventRow(response_id=row.id, seq=seq + 1, event=event))
                row.body, row.status = body, "failed"
                row.owner, row.lease_until = None, None
                failed.append(row.id)
        return failed

    def delete_expired(self, retention_s: int) -> int:
        """Delete the responses created more than `retention_s` ago; how many."""
        cutoff = self._clock() - retention_s
        with self.db.session() as session:
            old = sa.select(ResponseRow.id).where(ResponseRow.created_at < cutoff)
            session.execute(
                sa.delete(ResponseEventRow).where(ResponseEventRow.response_id.in_(old))
            )
            result = session.execute(sa.delete(ResponseRow).where(ResponseRow.created_at < cutoff))
            return int(getattr(result, "rowcount", 0))
