"""Tenancy operations shared by the CLI (`sluice tenants|keys|billing|prices`) and the admin API.

Each function takes the billing `Database`, does one job through the repositories, and
returns JSON-ready rows (str/int/None; times as ISO 8601), so `sluice … --json` and
`/admin/v1/…` print the same objects. Errors are `storage.errors` (InvalidInput → 400 /
exit 2, NotFound → 404, Conflict → 409, StoreUnavailable → 503 / exit 1).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from sluice.storage.adapters import AdapterInfo, AdapterStore
from sluice.storage.db import Database
from sluice.storage.errors import InvalidInput
from sluice.storage.keys import KeyInfo, KeyRepository
from sluice.storage.prices import Price, PriceBook
from sluice.storage.tenants import (
    PlanLimits,
    TenantInfo,
    TenantRepository,
    micros_to_usd,
    usd_to_micros,
)
from sluice.storage.usage import Report, usage_report

Row = dict[str, Any]


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _usd(micros: int | None) -> str | None:
    return None if micros is None else str(micros_to_usd(micros))


def tenant_row(t: TenantInfo) -> Row:
    return {
        "tenant_id": t.tenant_id,
        "name": t.name,
        "rpm": t.limits.rpm,
        "tpm": t.limits.tpm,
        "max_concurrency": t.limits.max_concurrency,
        "monthly_budget_usd": _usd(t.limits.monthly_budget_micros),
        "allowed_models": None if t.allowed_models is None else list(t.allowed_models),
        "created_at": _iso(t.created_at),
    }


def adapter_row(a: AdapterInfo) -> Row:
    return {
        "name": a.name,
        "base_model": a.base_model,
        "path": a.path,
        "tenant_id": a.owner_tenant_id,
        "created_at": _iso(a.created_at),
    }


def key_row(k: KeyInfo) -> Row:
    return {
        "key_id": k.key_id,
        "tenant_id": k.tenant_id,
        "tenant": k.tenant_name,
        "prefix": f"sk-sluice-{k.prefix}_…",
        "name": k.name,
        "created_at": _iso(k.created_at),
        "revoked_at": _iso(k.revoked_at),
        "last_used_at": _iso(k.last_used_at),
    }


def price_row(p: Price) -> Row:
    return {
        "model": p.model,
        "input_usd": str(micros_to_usd(p.input_micros)),
        "cached_input_usd": str(micros_to_usd(p.cached_input_micros)),
        "output_usd": str(micros_to_usd(p.output_micros)),
        "batch_discount": str(Decimal(p.batch_discount_bp) / 10_000),
    }


def create_tenant(
    db: Database,
    name: str,
    *,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrency: int | None = None,
    monthly_budget_usd: str | None = None,
    allowed_models: Sequence[str] | None = None,
) -> Row:
    """A tenant with its own plan and a first key named "default" (plaintext shown once);
    `allowed_models` None: every model."""
    budget = usd_to_micros(monthly_budget_usd) if monthly_budget_usd is not None else None
    limits = PlanLimits(rpm, tpm, max_concurrency, budget)
    tenant = TenantRepository(db).create(name, limits, allowed_models)
    key = KeyRepository(db).create(tenant.tenant_id, name="default")
    return {**tenant_row(tenant), "key_id": key.key_id, "api_key": key.api_key}


def list_tenants(db: Database) -> list[Row]:
    return [tenant_row(t) for t in TenantRepository(db).list()]


def set_allowed_models(db: Database, tenant: str, models: Sequence[str] | None) -> Row:
    """The served names (models, aliases, adapters) the tenant's keys may use; None: every
    one. Any other answers 404 as if it did not exist (the tenant's private adapters are
    always its own). Gateways apply it within their auth cache's TTL (5 s)."""
    return tenant_row(TenantRepository(db).set_allowed_models(tenant, models))


def has_tenants(db: Database) -> bool:
    """Whether any tenant exists (the gateway's static-key fallback needs an empty store)."""
    return TenantRepository(db).exists()


def create_key(db: Database, tenant: str, name: str | None = None) -> Row:
    key = KeyRepository(db).create(tenant, name=name)
    return {"key_id": key.key_id, "tenant_id": key.tenant_id, "api_key": key.api_key}


def list_keys(db: Database, tenant: str | None = None) -> list[Row]:
    return [key_row(k) for k in KeyRepository(db).list(tenant)]


def revoke_key(db: Database, key_id: str) -> Row:
    KeyRepository(db).revoke(key_id)
    return {"key_id": key_id, "revoked": True}


def parse_day(value: str | None, name: str) -> dt.date | None:
    if value is None:
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError as exc:
        raise InvalidInput(f"{name} expects a date like 2026-01-31, got {value!r}") from exc


def report(
    db: Database,
    *,
    tenant: str | None,
    since: dt.date | None = None,
    until: dt.date | None = None,
    by_id: bool = False,
) -> Report:
    """Usage for `tenant` (name or id; an exact tenant id when `by_id`), or all tenants.

    `by_id` is for a caller's own usage: the id comes from its key and is used as is, so
    a tenant whose rows exist only in the ledger (e.g. the static-key "default") works.
    """
    if since and until and since > until:
        raise InvalidInput("since is after until")
    if tenant is None or by_id:
        return usage_report(db, tenant_id=tenant, since=since, until=until)
    tenant_id = TenantRepository(db).get(tenant).tenant_id
    return usage_report(db, tenant_id=tenant_id, since=since, until=until, tenant_label=tenant)


def set_price(
    db: Database,
    model: str,
    *,
    input_usd: str,
    cached_input_usd: str,
    output_usd: str,
    batch_discount: str = "0",
) -> Row:
    price = PriceBook(db).set(
        model,
        input_usd=input_usd,
        cached_input_usd=cached_input_usd,
        output_usd=output_usd,
        batch_discount=batch_discount,
    )
    return price_row(price)


def list_prices(db: Database) -> list[Row]:
    return [price_row(p) for p in PriceBook(db).all().values()]


def check_adapter_dir(path: str) -> str:
    """The absolute path of a PEFT LoRA directory, or InvalidInput naming what is wrong: a
    readable `adapter_config.json` (a LoRA's, when it says) beside `.safetensors` weights.
    The gateway checks what the workers will load: the path must be the same on each."""
    directory = Path(path).expanduser()
    config = directory / "adapter_config.json"
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInput(f"no adapter_config.json in {path!r}: not a PEFT adapter") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput(f"cannot read {config}: {exc}") from None
    if not isinstance(loaded, dict):
        raise InvalidInput(f"{config} is not a JSON object")
    if loaded.get("peft_type", "LORA") != "LORA":
        raise InvalidInput(f"{config}: peft_type {loaded['peft_type']!r} is not LORA")
    if not any(directory.glob("*.safetensors")):
        raise InvalidInput(f"no .safetensors weights in {path!r} (adapter_model.safetensors)")
    return str(directory.resolve())


def load_adapter(
    db: Database, name: str, path: str, base_model: str, tenant: str | None = None
) -> Row:
    """Register a LoRA adapter (its directory checked first); `tenant` (name or id): private
    to it, else public. That `base_model` is served and `name` free is the gateway's check."""
    info = AdapterStore(db).register(name, base_model, check_adapter_dir(path), tenant)
    return adapter_row(info)


def unload_adapter(db: Database, name: str) -> Row:
    return adapter_row(AdapterStore(db).remove(name))


def list_adapters(db: Database, tenant: str | None = None) -> list[Row]:
    """Every adapter, or those a tenant (name or id) sees: the public ones and its own."""
    tenant_id = None if tenant is None else TenantRepository(db).get(tenant).tenant_id
    return [adapter_row(a) for a in AdapterStore(db).list(tenant_id)]
