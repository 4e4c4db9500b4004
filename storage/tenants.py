"""Tenants, their plan limits and allowed models (repository); the gateway reads both
through auth (`storage.keys.Principal`)."""

from __future__ import annotations

import datetime as dt
import secrets
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sluice.storage.db import Database
from sluice.storage.errors import Conflict, InvalidInput, NotFound
from sluice.storage.tables import Plan, Tenant

MICROS_PER_USD = 1_000_000
# What the database columns hold: Integer limits, BigInteger micro-dollars.
MAX_LIMIT = 2**31 - 1
MAX_USD = Decimal(2**63 - 1) / MICROS_PER_USD
MAX_ALLOWED_MODELS = 1000


@dataclass(frozen=True, slots=True)
class PlanLimits:
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
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and value > MAX_LIMIT:
                raise InvalidInput(f"{name} must be at most {MAX_LIMIT}, got {value}")

    @classmethod
    def of(cls, plan: Plan) -> PlanLimits:
        return cls(plan.rpm, plan.tpm, plan.max_concurrency, plan.monthly_budget_micros)


@dataclass(frozen=True, slots=True)
class TenantInfo:
    tenant_id: str
    name: str
    limits: PlanLimits
    created_at: dt.datetime
    # the served names (models, aliases, adapters) its keys may use; None: every one
    allowed_models: tuple[str, ...] | None = None


def check_models(models: Iterable[str] | None) -> tuple[str, ...] | None:
    """Allowed-model names as stored: each a valid name, in order, without repeats; None
    stays None (every model). Names are not checked against what is served: the store
    does not know it, and a name served later (an adapter loaded tomorrow) may be meant."""
    if models is None:
        return None
    if isinstance(models, str):
        raise InvalidInput("allowed models must be a list of model names, not one string")
    names = tuple(dict.fromkeys(check_text(m, "model name") for m in models))
    if len(names) > MAX_ALLOWED_MODELS:
        raise InvalidInput(f"at most {MAX_ALLOWED_MODELS} allowed models, got {len(names)}")
    return names


def _info(tenant: Tenant, plan: Plan) -> TenantInfo:
    allowed = None if tenant.allowed_models is None else tuple(tenant.allowed_models)
    return TenantInfo(tenant.id, tenant.name, PlanLimits.of(plan), tenant.created_at, allowed)


def usd_to_micros(usd: Decimal | str, max_usd: Decimal = MAX_USD) -> int:
    """Exact conversion; more than six decimals is refused rather than rounded."""
    value = to_decimal(usd)
    # finiteness first: comparing a NaN raises, and a huge exponent overflows the product
    if not value.is_finite() or value < 0 or value > max_usd:
        raise InvalidInput(f"not an amount between 0 and {max_usd} USD: {usd}")
    micros = value * MICROS_PER_USD
    if micros != micros.to_integral_value():
        raise InvalidInput(f"not an amount with at most 6 decimals: {usd}")
    return int(micros)


def check_text(value: str, what: str, max_chars: int = 200) -> str:
    """A name as the database can store it: stripped, 1-`max_chars` printable characters."""
    value = value.strip()
    if not value or len(value) > max_chars or not is_storable(value):
        raise InvalidInput(
            f"{what} must be 1-{max_chars} characters of valid Unicode, without control characters"
        )
    return value


def is_storable(value: str) -> bool:
    """No NUL or other control character, no lone surrogate (PostgreSQL refuses both)."""
    return not any(unicodedata.category(c) in {"Cc", "Cs"} for c in value)


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

    def create(
        self, name: str, limits: PlanLimits, allowed_models: Iterable[str] | None = None
    ) -> TenantInfo:
        name = check_text(name, "tenant name")
        allowed = check_models(allowed_models)
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
            tenant = Tenant(
                id=new_id("ten"),
                name=name,
                plan_id=plan.id,
                allowed_models=None if allowed is None else list(allowed),
            )
            session.add(plan)
            session.flush()
            session.add(tenant)
            session.flush()
            return _info(tenant, plan)

    def set_allowed_models(self, name_or_id: str, models: Iterable[str] | None) -> TenantInfo:
        """Replace the tenant's allowed models (None: every model). Gateways apply it as
        their auth cache lets the tenant's keys go (`KeyAuthenticator.cache_ttl_s`)."""
        allowed = check_models(models)
        with self.db.session() as session:
            tenant_id = self.resolve(session, name_or_id).tenant_id
            tenant = session.get(Tenant, tenant_id)
            assert tenant is not None  # resolved in this session
            tenant.allowed_models = None if allowed is None else list(allowed)
            session.flush()
            plan = session.get(Plan, tenant.plan_id)
            assert plan is not None  # a foreign key
            return _info(tenant, plan)

    def exists(self) -> bool:
        """Whether any tenant exists."""
        with self.db.session() as session:
            return session.scalar(sa.select(Tenant.id).limit(1)) is not None

    def list(self) -> list[TenantInfo]:
        with self.db.session() as session:
            rows = session.execute(
                sa.select(Tenant, Plan).join(Plan, Tenant.plan_id == Plan.id).order_by(Tenant.name)
            ).all()
            return [_info(t, p) for t, p in rows]

    def get(self, name_or_id: str) -> TenantInfo:
        with self.db.session() as session:
            return self.resolve(session, name_or_id)

    @staticmethod
    def resolve(session: Session, name_or_id: str) -> TenantInfo:
        if not is_storable(name_or_id):  # no such name can exist
            raise NotFound(f"no tenant named or with id {name_or_id!r}")
        row = session.execute(
            sa.select(Tenant, Plan)
            .join(Plan, Tenant.plan_id == Plan.id)
            .where(sa.or_(Tenant.id == name_or_id, Tenant.name == name_or_id))
        ).first()
        if row is None:
            raise NotFound(f"no tenant named or with id {name_or_id!r}")
        tenant, plan = row
        return _info(tenant, plan)
