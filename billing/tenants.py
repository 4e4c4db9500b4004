"""Tenants and their plan limits (repository); the gateway reads `Limits` through auth."""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import sqlalchemy as sa
from sqlalchemy.orm import Session

from billing.db import Database
from billing.errors import Conflict, InvalidInput, NotFound
from billing.models import Plan, Tenant

MICROS_PER_USD = 1_000_000


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits; None means unlimited. Budget in micro-dollars per month."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    monthly_budget_micros: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrency", "monthly_budget_micros"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidInput(f"{name} must be >= 0, got {value}")

    @classmethod
    def of(cls, plan: Plan) -> Limits:
        return cls(plan.rpm, plan.tpm, plan.max_concurrency, plan.monthly_budget_micros)


@dataclass(frozen=True, slots=True)
class TenantInfo:
    tenant_id: str
    name: str
    limits: Limits
    created_at: dt.datetime


def usd_to_micros(usd: Decimal | str) -> int:
    """Exact conversion; more than six decimals is refused rather than rounded."""
    value = to_decimal(usd)
    micros = value * MICROS_PER_USD
    if not value.is_finite() or micros != micros.to_integral_value() or value < 0:
        raise InvalidInput(f"not a non-negative amount with at most 6 decimals: {usd}")
    return int(micros)


def to_decimal(value: Decimal | str) -> Decimal:
    try:
        return Decimal(str(value).strip())
    except InvalidOperation as exc:
        raise InvalidInput(f"not a number: {value!r}") from exc


def micros_to_usd(micros: int) -> Decimal:
    return Decimal(micros) / MICROS_PER_USD


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(12)}"


class TenantRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, name: str, limits: Limits) -> TenantInfo:
        name = name.strip()
        if not name or len(name) > 200:
            raise InvalidInput("tenant name must be 1-200 characters")
        with self.db.session() as session:
            if session.scalar(sa.select(Tenant.id).where(Tenant.name == name)) is not None:
                raise Conflict(f"tenant {name!r} already exists")
            plan = Plan(
                id=new_id("plan"),
                name=f"tenant:{name}",
                rpm=limits.rpm,
                tpm=limits.tpm,
                max_concurrency=limits.max_concurrency,
                monthly_budget_micros=limits.monthly_budget_micros,
            )
            tenant = Tenant(id=new_id("ten"), name=name, plan_id=plan.id)
            session.add(plan)
            session.flush()
            session.add(tenant)
            session.flush()
            return TenantInfo(tenant.id, tenant.name, limits, tenant.created_at)

    def list(self) -> list[TenantInfo]:
        with self.db.session() as session:
            rows = session.execute(
                sa.select(Tenant, Plan).join(Plan, Tenant.plan_id == Plan.id).order_by(Tenant.name)
            ).all()
            return [TenantInfo(t.id, t.name, Limits.of(p), t.created_at) for t, p in rows]

    def get(self, name_or_id: str) -> TenantInfo:
        with self.db.session() as session:
            return self.resolve(session, name_or_id)

    @staticmethod
    def resolve(session: Session, name_or_id: str) -> TenantInfo:
        row = session.execute(
            sa.select(Tenant, Plan)
            .join(Plan, Tenant.plan_id == Plan.id)
            .where(sa.or_(Tenant.id == name_or_id, Tenant.name == name_or_id))
        ).first()
        if row is None:
            raise NotFound(f"no tenant named or with id {name_or_id!r}")
        tenant, plan = row
        return TenantInfo(tenant.id, tenant.name, Limits.of(plan), tenant.created_at)
