"""The SQL tables: tenants, plans, keys, LoRA adapters, prices, the usage ledger, files,
batches and lines, stored responses and their events.

Money is integers, never floats: budgets and prices in micro-dollars (1e-6 USD; prices
per million tokens), ledger costs in pico-dollars (1e-12 USD) so that
`tokens * micro-dollars per million tokens` is exact for every row. Times are UTC.

Billing periods are computed on demand from the ledger (`storage.ledger.period_spend`,
one range scan of the `(tenant_id, usage_day)` index) rather than kept as running
totals: a derived counter could drift from the ledger, a query cannot.
"""

from __future__ import annotations

import builtins
import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING)


class Plan(Base):
    """Plan limits; None means unlimited. Each tenant created by the CLI gets its own plan."""

    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200), unique=True)
    rpm: Mapped[int | None] = mapped_column(sa.Integer)
    tpm: Mapped[int | None] = mapped_column(sa.Integer)
    max_concurrency: Mapped[int | None] = mapped_column(sa.Integer)
    monthly_budget_micros: Mapped[int | None] = mapped_column(sa.BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200), unique=True)
    plan_id: Mapped[str] = mapped_column(sa.ForeignKey("plans.id"))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    # the served names (models, aliases, adapters) its keys may use; NULL: every one
    allowed_models: Mapped[builtins.list[str] | None] = mapped_column(sa.JSON(none_as_null=True))


class LoraAdapter(Base):
    """A LoRA adapter loaded at run time (`/v1/load_lora_adapter`): served under `name`
    on the pool of `base_model`; owner NULL: public, else private to that tenant."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    base_model: Mapped[str] = mapped_column(sa.String(200))
    path: Mapped[str] = mapped_column(sa.Text)
    owner_tenant_id: Mapped[str | None] = mapped_column(sa.ForeignKey("tenants.id"))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    """A key is `sk-sluice-<prefix>_<secret>`; only sha256 of the whole key is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(sa.String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(sa.String(64))
    name: Mapped[str | None] = mapped_column(sa.String(200))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True))
    last_used_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime(timezone=True))


class ModelPrice(Base):
    """Micro-dollars per million tokens; batch discount in basis points (5000 = 50 %)."""

    __tablename__ = "model_prices"

    model: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    input_micros: Mapped[int] = mapped_column(sa.BigInteger)
    cached_input_micros: Mapped[int] = mapped_column(sa.BigInteger)
    output_micros: Mapped[int] = mapped_column(sa.BigInteger)
    batch_discount_bp: Mapped[int] = mapped_column(sa.Integer, default=0)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class UsageEntry(Base):
    """One row per (request_id, attempt): the primary key is the idempotency key.

    No foreign key to tenants: the ledger is an append-only record of what the engine
    did, and must accept every usage record (a dangling tenant shows up in reports).
    """

    __tablename__ = "usage_ledger"
    __table_args__ = (sa.Index(None, "tenant_id", "usage_day"),)

    request_id: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    attempt: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(100))
    key_id: Mapped[str | None] = mapped_column(sa.String(100))
    model: Mapped[str] = mapped_column(sa.String(200))
    lane: Mapped[str] = mapped_column(sa.String(16))
    prompt_tokens: Mapped[int] = mapped_column(sa.Integer)
    cached_tokens: Mapped[int] = mapped_column(sa.Integer)
    completion_tokens: Mapped[int] = mapped_column(sa.Integer)
    cost_picos: Mapped[int] = mapped_column(sa.BigInteger)
    priced: Mapped[bool] = mapped_column(sa.Boolean)
    finish_reason: Mapped[str] = mapped_column(sa.String(16))
    queued_ms: Mapped[int] = mapped_column(sa.BigInteger)
    scheduled_ms: Mapped[int | None] = mapped_column(sa.BigInteger)
    first_token_ms: Mapped[int | None] = mapped_column(sa.BigInteger)
    finished_ms: Mapped[int] = mapped_column(sa.BigInteger)
    usage_day: Mapped[dt.date] = mapped_column(sa.Date)
    batch_id: Mapped[str | None] = mapped_column(sa.String(100))
    recorded_at: Mapped[dt.datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    # the resuming worker's count for a killed attempt (`UsageRecord.estimated`): the
    # attempt's own record replaces the row
    estimated: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())


# -- batches (docs/architecture.md §14) -------------------------------------------------
# Times are epoch seconds, as the OpenAI objects carry them.


class StoredFile(Base):
    """An uploaded batch input, or a batch's output or error file, with its bytes."""

    __tablename__ = "files"
    __table_args__ = (sa.Index(None, "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(100))
    purpose: Mapped[str] = mapped_column(sa.String(32))
    filename: Mapped[str] = mapped_column(sa.String(255))
    bytes: Mapped[int] = mapped_column(sa.BigInteger)
    created_at: Mapped[int] = mapped_column(sa.BigInteger)
    content: Mapped[builtins.bytes] = mapped_column(sa.LargeBinary)


class BatchRow(Base):
    """A batch's state: the OpenAI Batch object's fields plus what running it needs."""

    __tablename__ = "batches"
    __table_args__ = (sa.Index(None, "tenant_id", "created_at"), sa.Index(None, "status"))

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(100))
    key_id: Mapped[str | None] = mapped_column(sa.String(100))
    endpoint: Mapped[str] = mapped_column(sa.String(64))
    model: Mapped[str | None] = mapped_column(sa.String(200))
    input_file_id: Mapped[str] = mapped_column(sa.String(64))
    completion_window: Mapped[str] = mapped_column(sa.String(16))
    status: Mapped[str] = mapped_column(sa.String(16))
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", sa.JSON)
    errors: Mapped[list[dict[str, object]] | None] = mapped_column(sa.JSON)
    output_file_id: Mapped[str | None] = mapped_column(sa.String(64))
    error_file_id: Mapped[str | None] = mapped_column(sa.String(64))
    created_at: Mapped[int] = mapped_column(sa.BigInteger)
    expires_at: Mapped[int] = mapped_column(sa.BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    completed_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    failed_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    expired_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(sa.BigInteger)
    total: Mapped[int] = mapped_column(sa.Integer, default=0)
    completed: Mapped[int] = mapped_column(sa.Integer, default=0)
    failed: Mapped[int] = mapped_column(sa.Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    # prompt + max_tokens of the lines not yet finished: the tenant's batch queue limit
    enqueued_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    # the step running the batch (validate, dispatch) and until when it holds it: a step
    # whose process died stops renewing, and the sweep reruns it once this has passed
    lease_owner: Mapped[str | None] = mapped_column(sa.String(64))
    lease_until: Mapped[int | None] = mapped_column(sa.BigInteger)


class BatchLineRow(Base):
    """One input line: its request, and once finished its output or error line."""

    __tablename__ = "batch_lines"
    __table_args__ = (sa.UniqueConstraint("batch_id", "custom_id"),)

    batch_id: Mapped[str] = mapped_column(
        sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line: Mapped[int] = mapped_column(sa.Integer, primary_key=True)  # 0-based input order
    custom_id: Mapped[str] = mapped_column(sa.String(512))
    body: Mapped[str] = mapped_column(sa.Text)  # the line's request body, as JSON
    tokens: Mapped[int] = mapped_column(sa.Integer, default=0)  # prompt + max_tokens
    requests: Mapped[int] = mapped_column(sa.Integer, default=1)  # sub-requests (n, prompts)
    prompt_tokens: Mapped[int] = mapped_column(sa.Integer, default=0)  # each prompt once
    state: Mapped[str] = mapped_column(sa.String(16), default="pending")
    ok: Mapped[bool | None] = mapped_column(sa.Boolean)  # True: output file; False: error file
    result: Mapped[str | None] = mapped_column(sa.Text)  # the output or error line, as JSON


# -- stored responses (the Responses API's `store` and `background`) ----------------------
# Times are epoch seconds, as the OpenAI objects carry them.


class ResponseRow(Base):
    """A stored response: its object as last written, the input it ran on, who runs it."""

    __tablename__ = "responses"
    __table_args__ = (sa.Index(None, "status", "lease_until"), sa.Index(None, "created_at"))

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(100))
    status: Mapped[str] = mapped_column(sa.String(16))
    background: Mapped[bool] = mapped_column(sa.Boolean)
    body: Mapped[dict[str, object]] = mapped_column(sa.JSON)  # the response object
    input_items: Mapped[list[dict[str, object]]] = mapped_column(sa.JSON)
    created_at: Mapped[int] = mapped_column(sa.BigInteger)
    # a running background response: the gateway running it renews its lease; once the
    # lease lapses (that gateway died) any gateway's sweep fails the response
    owner: Mapped[str | None] = mapped_column(sa.String(64))
    lease_until: Mapped[int | None] = mapped_column(sa.BigInteger)
    cancel_requested: Mapped[bool] = mapped_column(sa.Boolean, default=False)


class ResponseEventRow(Base):
    """One stream event of a background response, numbered as it was first sent."""

    __tablename__ = "response_events"

    response_id: Mapped[str] = mapped_column(
        sa.ForeignKey("responses.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    event: Mapped[dict[str, object]] = mapped_column(sa.JSON)
