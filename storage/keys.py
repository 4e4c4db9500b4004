"""API keys: creation (shown once), revocation, and bearer-token authentication.

Format: `sk-sluice-<prefix>_<secret>`; prefix = 12 hex characters (the lookup index),
secret = 32 random bytes, URL-safe base64. Stored: sha256 of the whole key, hex.
A plain sha256 is the right hash here, not bcrypt/argon2: those slow hashes protect
*low-entropy* passwords from dictionary attacks; a 256-bit random secret cannot be
guessed, so a fast hash loses nothing and keeps authentication in microseconds.

`KeyAuthenticator.authenticate` raises the same `AuthenticationFailed` for malformed,
unknown and revoked keys, and compares hashes with `hmac.compare_digest` (a dummy
compare when the prefix is unknown, so timing does not tell which case it was).
Successful lookups are cached in-process for `cache_ttl_s` (default 5 s): a revoked key
keeps working for at most that long on a gateway that has just seen it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.errors import AuthenticationFailed, NotFound, StoreUnavailable
from sluice.storage.tables import ApiKey, Plan, Tenant, utcnow
from sluice.storage.tenants import PlanLimits, TenantRepository, check_text, is_storable, new_id

KEY_PREFIX = "sk-sluice-"
_KEY_RE = re.compile(r"^sk-sluice-([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_DUMMY_HASH = hashlib.sha256(b"sluice-dummy").hexdigest()
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def generate_key() -> tuple[str, str]:
    """(prefix, plaintext key)."""
    prefix = secrets.token_hex(6)
    return prefix, f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller, as admission and every route see it; tenant_id is also the cache salt.

    From the tenant store it carries the key, the tenant's plan `limits` and the served
    names it may use (`allowed_models`, None: every one; the catalog answers any other
    as not existing); a static gateway key (`api.auth.StaticKeyAuthenticator`) has no
    plan: limits None, no admission limits apply, every model."""

    tenant_id: str
    key_id: str | None = None
    limits: PlanLimits | None = None
    allowed_models: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class CreatedKey:
    key_id: str
    tenant_id: str
    prefix: str
    api_key: str  # plaintext: returned once, never stored


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: str
    tenant_id: str
    tenant_name: str
    prefix: str
    name: str | None
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


class KeyRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, tenant: str, name: str | None = None) -> CreatedKey:
        """A new key for the tenant named (or with id) `tenant`."""
        if name is not None:
            name = check_text(name, "key name")
        with self.db.session() as session:
            info = TenantRepository.resolve(session, tenant)
            prefix, plaintext = generate_key()
            row = ApiKey(
                id=new_id("key"),
                tenant_id=info.tenant_id,
                prefix=prefix,
                secret_hash=hash_key(plaintext),
                name=name,
            )
            session.add(row)
            session.flush()
            return CreatedKey(row.id, info.tenant_id, prefix, plaintext)

    def list(self, tenant: str | None = None) -> list[KeyInfo]:
        with self.db.session() as session:
            query = (
                sa.select(ApiKey, Tenant.name)
                .join(Tenant, ApiKey.tenant_id == Tenant.id)
                .order_by(Tenant.name, ApiKey.created_at)
            )
            if tenant is not None:
                tenant_id = TenantRepository.resolve(session, tenant).tenant_id
                query = query.where(ApiKey.tenant_id == tenant_id)
            return [
                KeyInfo(
                    k.id,
                    k.tenant_id,
                    name,
                    k.prefix,
                    k.name,
                    k.created_at,
                    k.revoked_at,
                    k.last_used_at,
                )
                for k, name in session.execute(query).all()
            ]

    def revoke(self, key_id: str) -> None:
        """Idempotent; effective on every gateway within the auth cache TTL."""
        with self.db.session() as session:
            key = session.get(ApiKey, key_id) if is_storable(key_id) else None
            if key is None:
                raise NotFound(f"no API key with id {key_id!r}")
            if key.revoked_at is None:
                key.revoked_at = utcnow()


class KeyAuthenticator:
    """Bearer token → Principal, with a short in-process positive cache."""

    def __init__(
        self,
        db: Database,
        *,
        cache_ttl_s: float = 5.0,
        stale_ttl_s: float = 300.0,
        max_cache_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.cache_ttl_s = cache_ttl_s
        # While the database is down, a key seen this recently still authenticates: an
        # outage of the store must not lock out every tenant (revocations wait for it).
        self.stale_ttl_s = stale_ttl_s
        self.max_cache_entries = max_cache_entries
        self._clock = clock
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def authenticate(self, bearer_token: str) -> Principal:
        token = bearer_token.removeprefix("Bearer ").strip()
        digest = hash_key(token)
        now = self._clock()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            principal = self._lookup(token, digest)
        except StoreUnavailable:
            if hit is not None and hit[0] + self.stale_ttl_s > now:
                return hit[1]
            raise
        with self._lock:
            if len(self._cache) >= self.max_cache_entries:
                self._cache.clear()
            self._cache[digest] = (now + self.cache_ttl_s, principal)
        return principal

    def invalidate(self) -> None:
        with self._lock:
            self._cache.clear()

    def _lookup(self, token: str, digest: str) -> Principal:
        match = _KEY_RE.match(token)
        prefix = match.group(1) if match else "-"
        with self.db.session() as session:
            row = session.execute(
                sa.select(ApiKey, Plan, Tenant.allowed_models)
                .join(Tenant, ApiKey.tenant_id == Tenant.id)
                .join(Plan, Tenant.plan_id == Plan.id)
                .where(ApiKey.prefix == prefix)
            ).first()
            stored = row[0].secret_hash if row is not None else _DUMMY_HASH
            same = hmac.compare_digest(digest.encode(), stored.encode())
            if row is None or not match or not same or row[0].revoked_at is not None:
                raise AuthenticationFailed()
            key, plan, allowed = row
            now = utcnow()
            last = key.last_used_at
            if last is None or now - _aware(last) > LAST_USED_RESOLUTION:
                key.last_used_at = now
            models = None if allowed is None else frozenset(allowed)
            return Principal(key.tenant_id, key.id, PlanLimits.of(plan), models)


def _aware(value: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes; every time in the store is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
