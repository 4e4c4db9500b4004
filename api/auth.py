"""Who is calling: bearer API key → (tenant_id, key_id), the first step of every request.

`Authenticator` is the seam: the static key set (`--api-key`) here, the tenant key store
(hashed keys in billing/) in `api.tenancy.TenantAuthenticator`. The tenant always comes
from the key, never from a header the client controls (docs/architecture.md §5.6).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Protocol

from fastapi import Request
from starlette.requests import HTTPConnection

from sluice.api.errors import AuthenticationFailed
from sluice.storage.keys import Principal as Principal  # the one Principal, re-exported

DEFAULT_TENANT = "default"


class Authenticator(Protocol):
    async def authenticate(self, api_key: str | None) -> Principal:
        """The caller for `api_key` (None: no bearer sent); raise AuthenticationFailed."""
        ...


def key_id_for(api_key: str) -> str:
    """A stable, non-secret name for a key (for logs and billing rows)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


class StaticKeyAuthenticator:
    """A fixed set of keys, all of them tenant "default".

    With no keys configured the gateway is open (development): any bearer, or none, is
    tenant "default" — the SDK insists on sending some key, so any key must work there.
    """

    def __init__(self, api_keys: Iterable[str], tenant_id: str = DEFAULT_TENANT) -> None:
        self._keys = {k for k in api_keys if k}
        self._tenant_id = tenant_id

    @property
    def open(self) -> bool:
        return not self._keys

    async def authenticate(self, api_key: str | None) -> Principal:
        if self.open:
            return Principal(self._tenant_id, key_id_for(api_key) if api_key else None)
        if api_key is None:
            raise AuthenticationFailed(
                "missing API key: send it as 'Authorization: Bearer <key>'", code="missing_api_key"
            )
        for known in self._keys:
            if hmac.compare_digest(known.encode(), api_key.encode()):
                return Principal(self._tenant_id, key_id_for(api_key))
        raise AuthenticationFailed("incorrect API key provided")


def bearer_token(conn: HTTPConnection) -> str | None:
    value = conn.headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def authenticate(conn: HTTPConnection) -> Principal:
    """Authenticate an HTTP request or a WebSocket handshake with the app's authenticator."""
    authenticator: Authenticator = conn.app.state.authenticator
    return await authenticator.authenticate(bearer_token(conn))


async def require_principal(request: Request) -> Principal:
    """FastAPI dependency for the /v1 routes."""
    return await authenticate(request)
