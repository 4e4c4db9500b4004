"""SQLAlchemy models of the billing store: tenants, plans, keys, prices, the usage ledger.

Money is integers, never floats: budgets and prices in micro-dollars (1e-6 USD; prices
per million tokens), ledger costs in pico-dollars (1e-12 USD) so that
`tokens * micro-dollars per million tokens` is exact for every row. Times are UTC.

Billing periods are computed on demand from the ledger (`billing.ledger.period_spend`,
one range scan of the `(tenant_id, usage_day)` index) rather than kept as running
totals: a derived counter could drift from the ledger, a query cannot.
"""

from __future__ import annotations

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
    """Limits; None means unlimited. Each tenant created by the CLI gets its own plan."""

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
