"""Model access in the store: a tenant's allowed models (on its keys' Principal) and the
LoRA adapter registry, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from sluice.storage.adapters import AdapterStore
from sluice.storage.db import Database
from sluice.storage.errors import Conflict, InvalidInput, NotFound
from sluice.storage.keys import KeyAuthenticator, KeyRepository
from sluice.storage.tenants import PlanLimits, TenantRepository


def test_allowed_models_are_stored_checked_and_on_the_principal(db: Database) -> None:
    tenants = TenantRepository(db)
    acme = tenants.create("acme", PlanLimits(), allowed_models=["a", " b ", "a"])
    open_ = tenants.create("open", PlanLimits())
    assert acme.allowed_models == ("a", "b")  # stripped, without repeats, in order
    assert open_.allowed_models is None and tenants.get("open").allowed_models is None
    assert tenants.get("acme").allowed_models == ("a", "b")
    assert tenants.set_allowed_models("open", []).allowed_models == ()
    assert tenants.set_allowed_models("acme", None).allowed_models is None
    assert {t.name: t.allowed_models for t in tenants.list()} == {"acme": None, "open": ()}
    for bad in (["ok", ""], ["x" * 201], ["bad\x00name"], "a-string"):
        with pytest.raises(InvalidInput):
            tenants.set_allowed_models("acme", bad)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        tenants.set_allowed_models("nobody", ["a"])

    tenants.set_allowed_models("acme", ["m1", "m2"])
    key = KeyRepository(db).create("acme")
    auth = KeyAuthenticator(db)
    assert auth.authenticate(key.api_key).allowed_models == frozenset({"m1", "m2"})
    other = KeyRepository(db).create("open")
    assert auth.authenticate(other.api_key).allowed_models == frozenset()
    tenants.set_allowed_models("open", None)
    auth.invalidate()
    assert auth.authenticate(other.api_key).allowed_models is None


def test_adapters_register_list_visible_and_remove(db: Database) -> None:
    tenants = TenantRepository(db)
    a = tenants.create("a", PlanLimits())
    b = tenants.create("b", PlanLimits())
    store = AdapterStore(db)
    public = store.register("pub", "base", "/ad/pub")
    mine = store.register("mine", "base", "/ad/mine", owner="a")  # by name
    theirs = store.register("theirs", "other", "/ad/theirs", owner=b.tenant_id)  # by id
    assert public.owner_tenant_id is None and mine.owner_tenant_id == a.tenant_id
    assert theirs.base_model == "other" and store.get("theirs").path == "/ad/theirs"
    assert [x.name for x in store.list()] == ["mine", "pub", "theirs"]
    assert [x.name for x in store.list(a.tenant_id)] == ["mine", "pub"]
    assert [x.name for x in store.list(b.tenant_id)] == ["pub", "theirs"]
    assert [x.name for x in store.list("ten_nobody")] == ["pub"]
    with pytest.raises(Conflict):
        store.register("pub", "base", "/elsewhere")
    with pytest.raises(NotFound):
        store.register("new", "base", "/ad/new", owner="nobody")
    with pytest.raises(InvalidInput):
        store.register("", "base", "/ad/x")
    assert store.remove("mine").name == "mine"
    with pytest.raises(NotFound):
        store.remove("mine")
    with pytest.raises(NotFound):
        store.get("bad\x00name")
    assert [x.name for x in store.list(a.tenant_id)] == ["pub"]
