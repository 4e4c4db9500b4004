"""The batch store: files, batches and batch lines in the SQL store.

Every process (gateways, the batches worker, `sluice serve`) reads and writes batches
here, so their state survives any process (docs/architecture.md §14). Each change is
one transaction and a compare-and-set on the batch's status where it moves the batch,
so any step may be rerun: a rerun finds the step done and changes nothing.

Tenancy: every read a tenant can cause takes its `tenant_id`, and another tenant's
file or batch reads as missing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.tables import BatchLineRow, BatchRow, StoredFile

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
RUNNING = frozenset({"validating", "in_progress", "finalizing", "cancelling"})


def new_id(prefix: str, sep: str = "_") -> str:
    """32 hex digits, the first 16 the creation time in ns: lists order by `created_at`
    (whole seconds, as the API gives it), then by id, so objects made in the same second
    still list newest first."""
    return f"{prefix}{sep}{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def now_s() -> int:
    return int(time.time())


@dataclass(frozen=True, slots=True)
class FileInfo:
    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """A snapshot of a batch row (`BatchRow`'s columns, `metadata` by its API name)."""

    id: str
    tenant_id: str
    key_id: str | None
    endpoint: str
    model: str | None
    input_file_id: str
    completion_window: str
    status: str
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int
    completed: int
    failed: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    enqueued_tokens: int

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


_BATCH_FIELDS = [f.name for f in fields(BatchInfo)]


def _batch_info(row: BatchRow) -> BatchInfo:
    values = {name: getattr(row, name) for name in _BATCH_FIELDS if name != "metadata"}
    return BatchInfo(metadata=row.batch_metadata, **values)


def _line_info(r: BatchLineRow) -> LineInfo:
    return LineInfo(
        r.batch_id, r.line, r.custom_id, r.body, r.tokens, r.requests, r.prompt_tokens,
        r.state, r.ok, r.result,
    )  # fmt: skip


def _file_info(row: StoredFile) -> FileInfo:
    return FileInfo(row.id, row.tenant_id, row.purpose, row.filename, row.bytes, row.created_at)


@dataclass(frozen=True, slots=True)
class NewLine:
    line: int
    custom_id: str
    body: str  # JSON
    tokens: int = 0  # prompt + max_tokens of every sub-request
    requests: int = 1
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LineInfo:
    batch_id: str
    line: int
    custom_id: str
    body: str
    tokens: int
    requests: int
    prompt_tokens: int
    state: str
    ok: bool | None
    result: str | None


@dataclass(frozen=True, slots=True)
class LineOutcome:
    """A finished line: its output (ok) or error line, and what it used."""

    line: int
    ok: bool
    result: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class BatchStore:
    def __init__(self, db: Database, clock: Callable[[], int] = now_s) -> None:
        self.db = db
        self.clock = clock  # whole seconds; injectable so a test can lapse a lease

    # -- files ---------------------------------------------------------------------
    def create_file(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: bytes,
        file_id: str | None = None,
    ) -> FileInfo:
        """Store a file; with `file_id` given and already stored, return that one."""
        with self.db.session() as s:
            if file_id is not None and (row := s.get(StoredFile, file_id)) is not None:
                return _file_info(row)
            row = StoredFile(
                id=file_id or new_id("file", "-"),  # OpenAI's shapes: file-…, batch_…
                tenant_id=tenant_id,
                purpose=purpose,
                filename=filename,
                bytes=len(content),
                created_at=self.clock(),
                content=content,
            )
            s.add(row)
            s.flush()
            return _file_info(row)

    def get_file(self, tenant_id: str, file_id: str) -> FileInfo | None:
        with self.db.session() as s:
            row = s.execute(
                sa.select(StoredFile)
                .where(StoredFile.id == file_id)
                .options(sa.orm.defer(StoredFile.content))
            ).scalar_one_or_none()
            return _file_info(row) if row is not None and row.tenant_id == tenant_id else None

    def file_content(self, tenant_id: str, file_id: str) -> bytes | None:
        with self.db.session() as s:
            row = s.execute(
                sa.select(StoredFile.tenant_id, StoredFile.content).where(StoredFile.id == file_id)
            ).one_or_none()
            return row.content if row is not None and row.tenant_id == tenant_id else None

    def list_files(
        self,
        tenant_id: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        order: str = "desc",
    ) -> list[FileInfo]:
        """Newest first (or oldest, `order="asc"`), starting after the file `after`."""
        columns = [c for c in StoredFile.__table__.c if c.name != "content"]
        query = sa.select(*columns).where(StoredFile.tenant_id == tenant_id)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        query = _page(query, StoredFile, after, order)
        with self.db.session() as s:
            rows = s.execute(query.limit(limit)).all()
        return [
            FileInfo(r.id, r.tenant_id, r.purpose, r.filename, r.bytes, r.created_at) for r in rows
        ]

    def delete_file(self, tenant_id: str, file_id: str) -> bool:
        with self.db.session() as s:
            result = s.execute(
                sa.delete(StoredFile).where(
                    StoredFile.id == file_id, StoredFile.tenant_id == tenant_id
                )
            )
            return bool(_rowcount(result))

    # -- batches -------------------------------------------------------------------
    def create_batch(
        self,
        *,
        tenant_id: str,
        key_id: str | None,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        window_s: int,
        metadata: dict[str, str] | None,
    ) -> BatchInfo:
        created = self.clock()
        row = BatchRow(
            id=new_id("batch"),
            tenant_id=tenant_id,
            key_id=key_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            batch_metadata=metadata,
            created_at=created,
            expires_at=created + window_s,
            total=0,
            completed=0,
            failed=0,
            input_tokens=0,
            cached_tokens=0,
            output_tokens=0,
            enqueued_tokens=0,
        )
        with self.db.session() as s:
            s.add(row)
            s.flush()
            return _batch_info(row)

    def get_batch(self, batch_id: str, tenant_id: str | None = None) -> BatchInfo | None:
        """The batch; with `tenant_id`, only if it is that tenant's."""
        with self.db.session() as s:
            row = s.get(BatchRow, batch_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            return _batch_info(row)

    def list_batches(
        self, tenant_id: str, *, after: str | None = None, limit: int = 20
    ) -> list[BatchInfo]:
        query = _page(
            sa.select(BatchRow).where(BatchRow.tenant_id == tenant_id), BatchRow, after, "desc"
        )
        with self.db.session() as s:
            return [_batch_info(r) for r in s.execute(query.limit(limit)).scalars()]

    def batches_with_status(self, statuses: Iterable[str]) -> list[BatchInfo]:
        with self.db.session() as s:
            rows = s.execute(sa.select(BatchRow).where(BatchRow.status.in_(list(statuses))))
            return [_batch_info(r) for r in rows.scalars()]

    def move(
        self, batch_id: str, from_statuses: Iterable[str], to_status: str, **values: Any
    ) -> bool:
        """Compare-and-set: move the batch to `to_status` (setting `<to_status>_at` and
        `values`) only if it is in one of `from_statuses`; False when it was not."""
        values = dict(values)
        stamp = f"{to_status}_at"
        if stamp in _BATCH_FIELDS and stamp not in values:
            values[stamp] = self.clock()
        with self.db.session() as s:
            result = s.execute(
                sa.update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.status.in_(list(from_statuses)))
                .values(status=to_status, **values)
            )
            return bool(_rowcount(result))

    def claim(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Take the batch's step lease for `ttl_s`, or renew it for its holder; False
        while another owner holds it (its step runs, or died less than its ttl ago)."""
        now = self.clock()
        with self.db.session() as s:
            result = s.execute(
                sa.update(BatchRow)
                .where(
                    BatchRow.id == batch_id,
                    sa.or_(
                        BatchRow.lease_owner.is_(None),
                        BatchRow.lease_owner == owner,
                        BatchRow.lease_until < now,
                    ),
                )
                .values(lease_owner=owner, lease_until=now + max(1, round(ttl_s)))
            )
            return bool(_rowcount(result))

    def release(self, batch_id: str, owner: str) -> None:
        """End the lease `owner` holds (nothing if it lapsed and another took it)."""
        with self.db.session() as s:
            s.execute(
                sa.update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.lease_owner == owner)
                .values(lease_owner=None, lease_until=None)
            )

    def enqueued_tokens(self, tenant_id: str) -> int:
        """Tokens (prompt + max_tokens) of the tenant's unfinished lines of running batches."""
        with self.db.session() as s:
            total = s.execute(
                sa.select(sa.func.coalesce(sa.func.sum(BatchRow.enqueued_tokens), 0)).where(
                    BatchRow.tenant_id == tenant_id, BatchRow.status.in_(list(RUNNING))
                )
            ).scalar_one()
            return int(total)

    # -- lines ---------------------------------------------------------------------
    def add_lines(self, batch_id: str, lines: Sequence[NewLine], *, enqueued_tokens: int) -> None:
        """Store a validated batch's lines and its totals, once (a rerun changes nothing)."""
        with self.db.session() as s:
            have = s.execute(
                sa.select(sa.func.count())
                .select_from(BatchLineRow)
                .where(BatchLineRow.batch_id == batch_id)
            ).scalar_one()
            if have:
                return
            s.execute(
                sa.insert(BatchLineRow),
                [
                    {
                        "batch_id": batch_id,
                        "line": ln.line,
                        "custom_id": ln.custom_id,
                        "body": ln.body,
                        "tokens": ln.tokens,
                        "requests": ln.requests,
                        "prompt_tokens": ln.prompt_tokens,
                        "state": "pending",
                    }
                    for ln in lines
                ],
            )
            s.execute(
                sa.update(BatchRow)
                .where(BatchRow.id == batch_id)
                .values(total=len(lines), enqueued_tokens=enqueued_tokens)
            )

    def lines(
        self, batch_id: str, *, states: Iterable[str] | None = None, chunk: int = 1000
    ) -> Iterator[list[LineInfo]]:
        """The batch's lines in input order, `chunk` at a time."""
        after = -1
        while True:
            query = sa.select(BatchLineRow).where(
                BatchLineRow.batch_id == batch_id, BatchLineRow.line > after
            )
            if states is not None:
                query = query.where(BatchLineRow.state.in_(list(states)))
            with self.db.session() as s:
                rows = s.execute(query.order_by(BatchLineRow.line).limit(chunk)).scalars().all()
                infos = [_line_info(r) for r in rows]
            if not infos:
                return
            yield infos
            after = infos[-1].line

    def mark_queued(self, batch_id: str, lines: Sequence[int]) -> None:
        """These lines were published to the batch lane (done ones stay done)."""
        with self.db.session() as s:
            s.execute(
                sa.update(BatchLineRow)
                .where(
                    BatchLineRow.batch_id == batch_id,
                    BatchLineRow.line.in_(list(lines)),
                    BatchLineRow.state == "pending",
                )
                .values(state="queued")
            )

    def requeue_unfinished(self, batch_id: str) -> int:
        """Queued lines back to pending (their requests were lost with an in-memory bus)."""
        with self.db.session() as s:
            result = s.execute(
                sa.update(BatchLineRow)
                .where(BatchLineRow.batch_id == batch_id, BatchLineRow.state == "queued")
                .values(state="pending")
            )
            return _rowcount(result)

    def finish_lines(self, batch_id: str, outcomes: Sequence[LineOutcome]) -> int:
        """Record finished lines, each at most once, and add them to the batch's counts
        in the same transaction; returns how many were new.

        Each line moves to done by an UPDATE conditional on it not being done yet, and
        only the lines that UPDATE moved are counted: the collector storing an answer and
        a cancel or expiry ending the same line at once never count it twice (a read
        first, then a write, let both see it unfinished).
        """
        if not outcomes:
            return 0
        new = 0
        totals = {"completed": 0, "failed": 0, "input_tokens": 0, "cached_tokens": 0}
        totals |= {"output_tokens": 0, "enqueued_tokens": 0}
        with self.db.session() as s:
            for outcome in outcomes:
                moved = s.execute(
                    sa.update(BatchLineRow)
                    .where(
                        BatchLineRow.batch_id == batch_id,
                        BatchLineRow.line == outcome.line,
                        BatchLineRow.state != "done",
                    )
                    .values(state="done", ok=outcome.ok, result=outcome.result)
                    .returning(BatchLineRow.tokens)
                ).scalar_one_or_none()
                if moved is None:
                    continue
                new += 1
                totals["completed" if outcome.ok else "failed"] += 1
                totals["input_tokens"] += outcome.prompt_tokens
                totals["cached_tokens"] += outcome.cached_tokens
                totals["output_tokens"] += outcome.completion_tokens
                totals["enqueued_tokens"] -= moved
            if new:
                s.execute(
                    sa.update(BatchRow)
                    .where(BatchRow.id == batch_id)
                    .values(
                        {getattr(BatchRow, k): getattr(BatchRow, k) + v for k, v in totals.items()}
                    )
                )
        return new

    def get_lines(self, batch_id: str, lines: Iterable[int]) -> dict[int, LineInfo]:
        with self.db.session() as s:
            rows = s.execute(
                sa.select(BatchLineRow).where(
                    BatchLineRow.batch_id == batch_id, BatchLineRow.line.in_(list(lines))
                )
            ).scalars()
            return {r.line: _line_info(r) for r in rows}

    def line_states(self, batch_id: str) -> dict[str, int]:
        """How many of the batch's lines are in each state (pending, queued, done)."""
        with self.db.session() as s:
            rows = s.execute(
                sa.select(BatchLineRow.state, sa.func.count())
                .where(BatchLineRow.batch_id == batch_id)
                .group_by(BatchLineRow.state)
            ).all()
            return {state: int(n) for state, n in rows}

    def queued_tokens(self, tenant_id: str) -> int:
        """Tokens (prompt + max_tokens) of the tenant's lines published and not finished,
        over all its batches: what its batches have in flight."""
        with self.db.session() as s:
            total = s.execute(
                sa.select(sa.func.coalesce(sa.func.sum(BatchLineRow.tokens), 0))
                .join(BatchRow, BatchRow.id == BatchLineRow.batch_id)
                .where(BatchRow.tenant_id == tenant_id, BatchLineRow.state == "queued")
            ).scalar_one()
            return int(total)

    def unfinished(self, batch_id: str) -> int:
        with self.db.session() as s:
            return int(
                s.execute(
                    sa.select(sa.func.count())
                    .select_from(BatchLineRow)
                    .where(BatchLineRow.batch_id == batch_id, BatchLineRow.state != "done")
                ).scalar_one()
            )


def _page(query: Any, model: Any, after: str | None, order: str) -> Any:
    """Order by (created_at, id) and start after the row `after` (cursor pagination)."""
    key = (model.created_at, model.id)
    if after is not None:
        cursor = sa.select(model.created_at).where(model.id == after).scalar_subquery()
        if order == "asc":
            query = query.where(sa.tuple_(*key) > sa.tuple_(cursor, after))
        else:
            query = query.where(sa.tuple_(*key) < sa.tuple_(cursor, after))
    if order == "asc":
        return query.order_by(model.created_at, model.id)
    return query.order_by(model.created_at.desc(), model.id.desc())


def _rowcount(result: Any) -> int:
    """Rows an UPDATE or DELETE matched (a CursorResult's; typed as Result by execute)."""
    return int(result.rowcount)
