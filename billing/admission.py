"""What the gateway calls: authenticate a bearer key, admit a request, settle it.

Flow (docs/architecture.md §1, §8):
1. `principal = admission.authenticate(authorization_header)` → AuthenticationFailed → 401.
2. `decision = admission.admit(principal, request_id=…, model=…, prompt_tokens=…,
   max_tokens=…)`; send `decision.headers()` on every response; when not
   `decision.allowed`: 429 (503 when `decision.reason == "unavailable"`) with them.
3. On the terminal delta (usage in hand): `admission.settle_terminal(...)` frees the
   concurrency slot and the unused tokens at once; it never raises. The quotas consumer
   settles the same (request_id, attempt) from the usage topic; whichever comes first
   counts, the other is a no-op. If the request is never published: `release(...)`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sluice.bus.messages import Usage, UsageRecord
from sluice.bus.topics import Lane
from sluice.storage.db import Database, embedded_url
from sluice.storage.errors import StoreError
from sluice.storage.keys import KeyAuthenticator, Principal
from sluice.storage.ledger import is_batch
from sluice.storage.prices import PriceBook, PriceCache, picos_to_micros_ceil
from sluice.storage.quota_memory import MemoryQuotaStore
from sluice.storage.quotas import Decision, QuotaStore, Reservation, Settlement, release

logger = logging.getLogger(__name__)


class UsageSettler:
    """Usage → quota settlement (actual tokens, actual cost); shared by gateway and consumer."""

    def __init__(self, quotas: QuotaStore, prices: PriceCache) -> None:
        self.quotas = quotas
        self.prices = prices

    def settle_usage(self, usage: UsageRecord) -> bool:
        """Apply one usage record; False when already applied. Raises StoreUnavailable."""
        return self.quotas.settle(
            self.settlement(
                usage.tenant_id,
                usage.request_id,
                usage.attempt,
                usage.model,
                Usage(
                    prompt_tokens=usage.prompt_tokens,
                    cached_tokens=usage.cached_tokens,
                    completion_tokens=usage.completion_tokens,
                ),
                batch=is_batch(usage),
                estimated=usage.estimated,
            )
        )

    def settlement(
        self, tenant_id: str, request_id: str, attempt: int, model: str, usage: Usage, *,
        batch: bool, estimated: bool = False,
    ) -> Settlement:  # fmt: skip
        price = self.prices.get(model)
        picos = 0
        if price is not None:
            picos = price.cost_picos(
                usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, batch=batch
            )
        tokens = usage.prompt_tokens + usage.completion_tokens
        micros = picos_to_micros_ceil(picos)
        return Settlement(tenant_id, request_id, attempt, tokens, micros, estimated)


class AdmissionService:
    def __init__(self, auth: KeyAuthenticator, quotas: QuotaStore, prices: PriceCache) -> None:
        self.auth = auth
        self.quotas = quotas
        self.prices = prices
        self.settler = UsageSettler(quotas, prices)

    def authenticate(self, bearer_token: str) -> Principal:
        """`Bearer sk-sluice-…` or the bare key → Principal; else AuthenticationFailed."""
        return self.auth.authenticate(bearer_token)

    def admit(
        self,
        principal: Principal,
        *,
        request_id: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        attempt: int = 0,
        lane: Lane = Lane.STANDARD,
        batch: bool = False,
    ) -> Decision:
        """Reserve rpm, tpm (prompt + max_tokens), a concurrency slot and a budget estimate."""
        price = self.prices.get(model)
        batch = batch or lane == Lane.BATCH
        estimate = price.estimate_micros(prompt_tokens, max_tokens, batch=batch) if price else 0
        reservation = Reservation(
            principal.tenant_id, request_id, attempt, prompt_tokens + max_tokens, estimate
        )
        if principal.limits is None:
            raise ValueError(f"tenant {principal.tenant_id!r}: admission needs its plan limits")
        return self.quotas.admit(principal.limits, reservation)

    def settle_terminal(
        self,
        *,
        tenant_id: str,
        request_id: str,
        attempt: int,
        model: str,
        lane: Lane,
        usage: Usage,
        batch_id: str | None = None,
    ) -> bool:
        """Settle from the terminal delta's usage; logs and returns False on failure."""
        batch = lane == Lane.BATCH or batch_id is not None
        try:
            settlement = self.settler.settlement(
                tenant_id, request_id, attempt, model, usage, batch=batch
            )
            return self.quotas.settle(settlement)
        except StoreError as exc:
            logger.warning(
                "settle on terminal delta failed request_id=%s tenant_id=%s: %s "
                "(the quotas consumer settles it from the usage topic)",
                request_id, tenant_id, exc,
            )  # fmt: skip
            return False

    def release(self, tenant_id: str, request_id: str, attempt: int = 0) -> bool:
        """Give back an admission whose request was never published (no usage will come)."""
        return release(self.quotas, tenant_id, request_id, attempt)

    def close(self) -> None:
        self.quotas.close()
        self.auth.db.close()


def open_admission(
    *,
    database_url: str | None,
    redis_url: str | None,
    data_dir: Path,
    fallback_replicas: int = 1,
    redis_prefix: str = "sluice:quota",
    auth_cache_ttl_s: float = 5.0,
) -> AdmissionService:
    """Embedded (SQLite + in-process quotas) or distributed (PostgreSQL/Redis) admission."""
    db = Database.connect(
        database_url or embedded_url(data_dir), migrate_if_needed=database_url is None
    )
    quotas: QuotaStore
    if redis_url:
        from sluice.storage.quota_redis import RedisQuotaStore

        quotas = RedisQuotaStore(
            redis_url, prefix=redis_prefix, fallback_replicas=fallback_replicas
        )
    else:
        quotas = MemoryQuotaStore()
    auth = KeyAuthenticator(db, cache_ttl_s=auth_cache_ttl_s)
    return AdmissionService(auth, quotas, PriceCache(PriceBook(db)))
