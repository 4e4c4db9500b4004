"""The LoRA adapter registry: adapters loaded at run time, shared by every gateway on the
database (the admin API's `/v1/load_lora_adapter` writes it; `api.served.ModelCatalog`
reads it on a short refresh).

An adapter is served under its `name` on the pool of `base_model`; the worker loads the
PEFT directory at `path`. `owner_tenant_id` None: public (listed to every tenant allowed
its base); else private to that tenant. Names are unique across the registry; that a name
clashes with no served model or alias is the gateway's check (the store does not know
what is served).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from sluice.storage.db import Database
from sluice.storage.errors import Conflict, NotFound
from sluice.storage.tables import LoraAdapter
from sluice.storage.tenants import TenantRepository, check_text, is_storable

MAX_PATH_CHARS = 4096


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    base_model: str
    path: str
    owner_tenant_id: str | None
    created_at: dt.datetime

    def visible_to(self, tenant_id: str) -> bool:
        return self.owner_tenant_id is None or self.owner_tenant_id == tenant_id


def _info(row: LoraAdapter) -> AdapterInfo:
    return AdapterInfo(row.name, row.base_model, row.path, row.owner_tenant_id, row.created_at)


class AdapterStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def register(
        self, name: str, base_model: str, path: str, owner: str | None = None
    ) -> AdapterInfo:
        """A new adapter; `owner` a tenant name or id (None: public). Conflict when the
        name is taken, NotFound when the owner does not exist."""
        name = check_text(name, "adapter name")
        base_model = check_text(base_model, "base model")
        path = check_text(path, "adapter path", MAX_PATH_CHARS)
        with self.db.session() as session:
            owner_id = None
            if owner is not None:
                owner_id = TenantRepository.resolve(session, owner).tenant_id
            if session.get(LoraAdapter, name) is not None:
                raise Conflict(f"the LoRA adapter {name!r} is already loaded")
            row = LoraAdapter(name=name, base_model=base_model, path=path, owner_tenant_id=owner_id)
            session.add(row)
            try:
                session.flush()
            except IntegrityError as exc:  # a racing load of the same name
                raise Conflict(f"the LoRA adapter {name!r} is already loaded") from exc
            return _info(row)

    def remove(self, name: str) -> AdapterInfo:
        """Unregister it; NotFound when no adapter has that name."""
        with self.db.session() as session:
            row = session.get(LoraAdapter, name) if is_storable(name) else None
            if row is None:
                raise NotFound(f"no LoRA adapter named {name!r}")
            info = _info(row)
            session.delete(row)
            return info

    def get(self, name: str) -> AdapterInfo:
        with self.db.session() as session:
            row = session.get(LoraAdapter, name) if is_storable(name) else None
            if row is None:
                raise NotFound(f"no LoRA adapter named {name!r}")
            return _info(row)

    def list(self, tenant_id: str | None = None) -> list[AdapterInfo]:
        """Every adapter by name, or with `tenant_id` those visible to that tenant (the
        public ones and its own)."""
        query = sa.select(LoraAdapter).order_by(LoraAdapter.name)
        if tenant_id is not None:
            query = query.where(
                sa.or_(
                    LoraAdapter.owner_tenant_id.is_(None),
                    LoraAdapter.owner_tenant_id == tenant_id,
                )
            )
        with self.db.session() as session:
            return [_info(row) for row in session.scalars(query)]
