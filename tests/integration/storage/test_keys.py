"""Tenants and API keys: create, authenticate, revoke; one error for every bad key."""

from __future__ import annotations

import hashlib

import pytest
import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.errors import AuthenticationFailed, Conflict, InvalidInput, NotFound
from sluice.storage.keys import KeyAuthenticator, KeyRepository
from sluice.storage.tables import ApiKey
from sluice.storage.tenants import PlanLimits, TenantRepository, usd_to_micros


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tenant_create_list_and_unique_name(db: Database) -> None:
    tenants = TenantRepository(db)
    limits = PlanLimits(rpm=60, tpm=10_000, max_concurrency=4, monthly_budget_micros=25_000_000)
    acme = tenants.create("acme", limits)
    tenants.create("beta", PlanLimits())
    assert acme.tenant_id.startswith("ten_")
    assert [t.name for t in tenants.list()] == ["acme", "beta"]
    assert tenants.get("acme").limits == limits
    assert tenants.get(acme.tenant_id).name == "acme"
    with pytest.raises(Conflict):
        tenants.create("acme", PlanLimits())
    with pytest.raises(NotFound):
        tenants.get("nobody")


def test_key_is_shown_once_stored_as_a_hash_and_authenticates(db: Database) -> None:
    tenant = TenantRepository(db).create("acme", PlanLimits(rpm=5))
    created = KeyRepository(db).create("acme")
    assert created.api_key.startswith(f"sk-sluice-{created.prefix}_")
    with db.session() as session:
        row = session.get(ApiKey, created.key_id)
        assert row is not None
        assert row.secret_hash == hashlib.sha256(created.api_key.encode()).hexdigest()
        assert created.api_key not in (row.secret_hash, row.prefix)
    principal = KeyAuthenticator(db).authenticate(f"Bearer {created.api_key}")
    assert (principal.tenant_id, principal.key_id) == (tenant.tenant_id, created.key_id)
    assert principal.limits == PlanLimits(rpm=5)
    listed = KeyRepository(db).list()
    assert [k.key_id for k in listed] == [created.key_id]
    assert listed[0].last_used_at is not None


def test_unknown_revoked_and_malformed_keys_get_the_same_error(db: Database) -> None:
    TenantRepository(db).create("acme", PlanLimits())
    keys = KeyRepository(db)
    revoked = keys.create("acme")
    keys.revoke(revoked.key_id)
    valid = keys.create("acme")
    wrong_secret = valid.api_key[:-4] + ("AAAA" if not valid.api_key.endswith("AAAA") else "BBBB")
    unknown_prefix = "sk-sluice-000000000000_" + valid.api_key.split("_", 1)[1]
    auth = KeyAuthenticator(db)
    messages = set()
    for bad in [
        revoked.api_key,
        wrong_secret,
        unknown_prefix,
        "sk-sluice-",
        "",
        "Bearer x",
        valid.api_key + "\n\x00",
        valid.api_key.upper(),
    ]:
        with pytest.raises(AuthenticationFailed) as info:
            auth.authenticate(bad)
        messages.add(str(info.value))
    assert messages == {"invalid API key"}
    assert auth.authenticate(valid.api_key).key_id == valid.key_id


def test_revocation_takes_effect_within_the_cache_ttl(db: Database) -> None:
    TenantRepository(db).create("acme", PlanLimits())
    keys = KeyRepository(db)
    created = keys.create("acme")
    clock = Clock()
    auth = KeyAuthenticator(db, cache_ttl_s=5.0, clock=clock)
    auth.authenticate(created.api_key)
    keys.revoke(created.key_id)
    keys.revoke(created.key_id)  # idempotent
    clock.now += 4.9
    auth.authenticate(created.api_key)  # still cached
    clock.now += 0.2
    with pytest.raises(AuthenticationFailed):
        auth.authenticate(created.api_key)
    with pytest.raises(NotFound):
        keys.revoke("key_missing")


def test_keys_for_an_unknown_tenant_and_bad_amounts_are_refused(db: Database) -> None:
    with pytest.raises(NotFound):
        KeyRepository(db).create("nobody")
    assert usd_to_micros("12.345678") == 12_345_678
    for bad in ["-1", "0.0000001", "NaN", "abc"]:
        with pytest.raises(InvalidInput):
            usd_to_micros(bad)
    with pytest.raises(InvalidInput):
        PlanLimits(rpm=-1)


def test_keys_listing_is_per_tenant(db: Database) -> None:
    tenants = TenantRepository(db)
    tenants.create("a", PlanLimits())
    tenants.create("b", PlanLimits())
    keys = KeyRepository(db)
    ka = keys.create("a")
    keys.create("b")
    assert [k.key_id for k in keys.list("a")] == [ka.key_id]
    with db.session() as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(ApiKey)) == 2
