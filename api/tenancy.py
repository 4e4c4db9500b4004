"""Tenancy at the gateway: tenant keys → Principal, admission before publish, settlement.

The gateway's adapter over `billing.admission.AdmissionService` (docs/architecture.md §8):

- `TenantAuthenticator`: a bearer key is looked up in the tenant store (hashed keys,
  constant-time compare inside billing). Unknown, revoked and malformed keys get the
  same 401. Precedence of the static keys (`--api-key`, `SLUICE_API_KEYS`): they are
  accepted, as tenant "default" without limits, only while the tenant store holds no
  tenant at all; once the first tenant exists, only tenant keys work.
- `GatewayAdmission.submit`: every sub-request of a call (n choices, several prompts)
  is admitted against the tenant's limits BEFORE anything is published: requests per
  minute, tokens per minute (prompt + max_tokens reserved), concurrency, monthly
  budget. A denial is 429 (`RateLimited`, or `QuotaExceeded` for the budget, which wins
  over any rate limit denied with it) or 503 (`QuotaUnavailable`: Redis down for a
  budgeted tenant); the sub-requests already admitted are released. A call that no wait
  can admit (more sub-requests than `max_concurrency`, more tokens than `tpm`) is a 400.
  The decision's `x-ratelimit-*` headers are put on the connection's scope state, and
  `GatewayMiddleware` adds them to every response of the call (the initial response of
  a stream, errors after admission too).
- Settlement: the reply consumer calls `settle` for the first terminal delta of every
  admitted sub-request, also after the client went away (the engine answers a Cancel
  with an abort delta carrying its usage) or the deadline passed; it frees the
  concurrency slot and the unused tokens and adds the actual cost. A publish failure
  releases the reservation. At gateway shutdown nothing is released here: the engine
  still answers the Cancels with usage records, and the quotas consumer settles them
  (otherwise the lease expires after 15 minutes). Settlement is deduplicated with the
  quotas consumer by (request_id, attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from functools import partial

from starlette.requests import HTTPConnection

from sluice.api.auth import Principal, StaticKeyAuthenticator
from sluice.api.errors import (
    APIError,
    AuthenticationFailed,
    InvalidRequest,
    QuotaExceeded,
    QuotaUnavailable,
    RateLimited,
    ServiceUnavailable,
)
from sluice.api.generation import Generation
from sluice.api.service import GatewayService
from sluice.billing import admin
from sluice.billing.admission import AdmissionService
from sluice.bus.messages import GenerateRequest, TokenDelta
from sluice.storage import errors as store_errors
from sluice.storage.quotas import Decision, unfit
from sluice.tracing.metrics import count_admission

logger = logging.getLogger(__name__)

RATELIMIT_STATE = "ratelimit_headers"
_LIMIT_NAMES = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "concurrent requests",
}


class TenantAuthenticator:
    """Bearer key → the tenant's Principal (with its limits) from the tenant store."""

    def __init__(
        self,
        admission: AdmissionService,
        static: StaticKeyAuthenticator | None = None,
        *,
        empty_check_ttl_s: float = 5.0,
    ) -> None:
        self._admission = admission
        self._static = static if static is not None and not static.open else None
        self._empty_check_ttl_s = empty_check_ttl_s
        self._empty: tuple[float, bool] | None = None

    async def authenticate(self, api_key: str | None) -> Principal:
        if api_key is None:
            raise AuthenticationFailed(
                "missing API key: send it as 'Authorization: Bearer <key>'", code="missing_api_key"
            )
        try:
            found = await asyncio.to_thread(self._admission.authenticate, api_key)
        except store_errors.AuthenticationFailed:
            if self._static is not None and await self._store_empty():
                return await self._static.authenticate(api_key)
            raise AuthenticationFailed("incorrect API key provided") from None
        except store_errors.StoreUnavailable as exc:
            # the static keys stay valid through an outage if the store was empty when
            # last seen (a tenant created meanwhile takes over once it answers again)
            if self._static is not None and self._empty is not None and self._empty[1]:
                with contextlib.suppress(AuthenticationFailed):
                    return await self._static.authenticate(api_key)
            raise ServiceUnavailable(
                "the API key store is unavailable; retry shortly", code="auth_unavailable"
            ) from exc
        return Principal(found.tenant_id, found.key_id, found.limits, found.allowed_models)

    async def _store_empty(self) -> bool:
        now = time.monotonic()
        if self._empty is None or self._empty[0] <= now:
            db = self._admission.auth.db
            try:
                empty = not await asyncio.to_thread(admin.has_tenants, db)
            except store_errors.StoreUnavailable:
                if self._empty is None:
                    raise
                return self._empty[1]  # the last answer serves through an outage
            self._empty = (now + self._empty_check_ttl_s, empty)
        return self._empty[1]


def denial(decision: Decision) -> APIError:
    """The HTTP error for a denied admission, with its headers."""
    headers = decision.headers()
    reason = decision.reason
    if reason != "budget":  # a budget is not retried (see `Decision.headers`)
        headers["retry-after-ms"] = str(max(1000, int(decision.retry_after_s * 1000)))
    if reason == "budget":
        return QuotaExceeded(
            "You exceeded your monthly budget; it resets at the start of next month (UTC). "
            "Ask your administrator to raise the budget.",
            headers,
        )
    if reason == "unavailable":
        return QuotaUnavailable(
            "the quota store is unavailable, and this tenant has a budget; retry shortly",
            headers,
        )
    limit = _LIMIT_NAMES.get(reason or "", "rate limit")
    return RateLimited(
        f"Rate limit reached on {limit}. Retry after {headers['retry-after']}s.", headers
    )


def check_fits(principal: Principal, requests: Sequence[GenerateRequest]) -> None:
    """A 400, not a 429 retried for ever, for a call larger than the tenant's plan allows."""
    assert principal.limits is not None
    tokens = [len(r.prompt_token_ids) + r.sampling.max_tokens for r in requests]
    found = unfit(principal.limits, tokens)
    if found is None:
        return
    count_admission("rejected", f"exceeds_{found.reason}", len(requests))
    if found.reason == "concurrency":
        raise InvalidRequest(
            f"this call needs {found.requested} concurrent requests (one per prompt and "
            f"choice), more than this tenant's limit of {found.limit} (max_concurrency): "
            "send fewer prompts or a lower n",
            code="exceeds_plan_limit",
        )
    raise InvalidRequest(
        f"this call reserves {found.requested} tokens (prompt + max_tokens of each prompt "
        f"and choice), more than this tenant's limit of {found.limit} tokens per minute "
        "(tpm): lower max_tokens, or send fewer prompts or a lower n",
        code="exceeds_plan_limit",
    )


class GatewayAdmission:
    """Admits a call's sub-requests before publishing; settles them on terminal deltas."""

    def __init__(self, admission: AdmissionService, service: GatewayService) -> None:
        self.admission = admission
        self.service = service
        service.watch_terminals(self.settle)

    async def submit(
        self, conn: HTTPConnection, principal: Principal, requests: Sequence[GenerateRequest],
        deadline_ms: int | None,
    ) -> Generation:  # fmt: skip
        """Admit, publish, and track; raises 429/503 before anything is published."""
        if principal.limits is None:
            count_admission("admitted", "unlimited", len(requests))
            return await self.service.submit(requests, deadline_ms)
        check_fits(principal, requests)
        headers = await asyncio.to_thread(self._admit_all, principal, requests)
        conn.scope.setdefault("state", {})[RATELIMIT_STATE] = headers
        try:
            return await self.service.submit(requests, deadline_ms)
        except BaseException:
            # any failure after admission gives back what admission took
            for request in self.service.forget_terminals(requests):
                await asyncio.to_thread(self._release, request)
            raise

    def _admit_all(
        self, principal: Principal, requests: Sequence[GenerateRequest]
    ) -> dict[str, str]:
        admitted: list[GenerateRequest] = []
        decision: Decision | None = None
        for request in requests:
            try:
                decision = self._admit(principal, request)
            except ServiceUnavailable:
                count_admission("rejected", "store_unavailable", len(requests))
                raise
            if not decision.allowed:
                # the call's sub-requests are all turned away, by this limit
                count_admission("rejected", decision.reason or "rate_limit", len(requests))
                for done in admitted:
                    self._release(done)
                logger.info(
                    "denied request_id=%s tenant_id=%s reason=%s degraded=%s",
                    request.request_id, principal.tenant_id, decision.reason, decision.degraded,
                )  # fmt: skip
                raise denial(decision)
            admitted.append(request)
        assert decision is not None
        count_admission("admitted", "within_limits", len(requests))
        return decision.headers()

    def _admit(self, principal: Principal, request: GenerateRequest) -> Decision:
        assert principal.limits is not None and principal.key_id is not None
        try:
            return self.admission.admit(
                principal,
                request_id=request.request_id,
                model=request.model,
                prompt_tokens=len(request.prompt_token_ids),
                max_tokens=request.sampling.max_tokens,
                attempt=request.attempt,
                lane=request.lane,
                batch=request.batch_id is not None,
            )
        except store_errors.StoreUnavailable as exc:  # e.g. no price cache and no database
            raise ServiceUnavailable(
                "admission is unavailable; retry shortly", code="quota_store_unavailable"
            ) from exc

    def _release(self, request: GenerateRequest) -> None:
        try:
            self.admission.release(request.tenant_id, request.request_id, request.attempt)
        except store_errors.StoreError as exc:
            logger.warning("release failed request_id=%s: %s", request.request_id, exc)

    def settle(self, request: GenerateRequest, delta: TokenDelta) -> None:
        """On the event loop: hand the settlement to a thread (it talks to Redis)."""
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, partial(self._settle, request, delta))

    def _settle(self, request: GenerateRequest, delta: TokenDelta) -> None:
        """Settle the admitted attempt from the terminal delta's usage.

        A terminal of a later attempt (failover) only ends the admitted attempt's lease:
        the quotas consumer bills that attempt from its exact usage record. So does a
        terminal without usage. The delta's usage is the client's view (the whole
        completion, the full prompt); the ledger keeps the engine's records, so quota
        spend may run slightly above the ledger (abort before the prompt ran), never below.
        """
        if delta.attempt != request.attempt:
            self._release(request)
            return
        if delta.usage is None:
            return
        self.admission.settle_terminal(
            tenant_id=request.tenant_id,
            request_id=request.request_id,
            attempt=request.attempt,
            model=request.model,
            lane=request.lane,
            usage=delta.usage,
            batch_id=request.batch_id,
        )
