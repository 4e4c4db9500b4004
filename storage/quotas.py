"""The `QuotaStore` contract: atomic admission against a tenant's limits, settled by usage.

Admission (`admit`) checks and reserves in one atomic step, all or nothing:
- requests per minute: GCRA (a leaky bucket that allows a burst of `rpm`), so there is
  no window edge at which twice the limit gets through;
- tokens per minute: `prompt_tokens + max_tokens` reserved in the current minute window;
- concurrency: a lease per admitted (request_id, attempt), expiring after `lease_s` so a
  request whose usage never arrives cannot hold a slot (or a budget reservation) for ever;
- monthly budget: spend this month + estimates of requests in flight + this estimate
  must stay within the budget.
Settlement (`settle`, from the usage record; `release` when no usage will ever come)
gives back the unused token reservation, ends the lease, drops the estimate and adds
the actual spend. It is deduplicated by (request_id, attempt) for `dedupe_ttl_s`
(default 24 h): replays inside that window change nothing, except that an attempt's own
settlement after an estimated one (`Settlement.estimated`) adds the difference in
tokens (this minute) and spend, as the ledger replaces the estimate's row.

Implementations: `MemoryQuotaStore` (embedded, one process) and `RedisQuotaStore` (one
Lua script per call); both pass the same contract suite.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from sluice.storage.tenants import PlanLimits

DenyReason = Literal["requests", "tokens", "concurrency", "budget", "unavailable"]
REASONS: tuple[DenyReason, ...] = ("requests", "tokens", "concurrency", "budget", "unavailable")
WINDOW_MS = 60_000
DEFAULT_LEASE_S = 900.0
DEFAULT_DEDUPE_TTL_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one request asks for at admission."""

    tenant_id: str
    request_id: str
    attempt: int
    tokens: int  # prompt_tokens + max_tokens
    cost_micros: int = 0  # upper-bound estimate, for the budget

    @property
    def member(self) -> str:
        return f"{self.request_id}:{self.attempt}"


@dataclass(frozen=True, slots=True)
class Settlement:
    """What one attempt actually used (from its usage record)."""

    tenant_id: str
    request_id: str
    attempt: int
    tokens: int  # prompt_tokens + completion_tokens
    cost_micros: int
    # a resuming worker's count for a killed attempt (`UsageRecord.estimated`): the
    # attempt's own settlement, arriving later, adds what it counted beyond the estimate
    estimated: bool = False

    @property
    def member(self) -> str:
        return f"{self.request_id}:{self.attempt}"


@dataclass(frozen=True, slots=True)
class Decision:
    """Allow or deny, with what the `x-ratelimit-*` and `retry-after` headers need."""

    allowed: bool
    reason: DenyReason | None = None
    retry_after_s: float = 0.0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    degraded: bool = False  # decided by the local fallback: Redis is unreachable

    def headers(self) -> dict[str, str]:
        """OpenAI's header names; a dimension without a limit sends no headers.

        A spent budget sends no `retry-after`: it resets next month, so the client should
        not retry (`x-should-retry: false`), and days in seconds help no one.
        """
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(remaining or 0, 0))
            out[f"x-ratelimit-reset-{kind}"] = format_duration(reset or 0.0)
        if not self.allowed and self.reason != "budget":
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


class QuotaStore(Protocol):
    """Admission limits shared by every gateway; settled from the usage stream."""

    def admit(self, limits: PlanLimits, reservation: Reservation) -> Decision: ...

    def settle(self, settlement: Settlement) -> bool:
        """Apply actual usage once; False when this (request_id, attempt) was settled."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Unfit:
    """A call no wait can admit: it asks more of one limit than the limit holds."""

    reason: DenyReason  # "concurrency" or "tokens"
    limit: int
    requested: int


def unfit(limits: PlanLimits, tokens: Sequence[int]) -> Unfit | None:
    """The limit a call exceeds on its own, if any; `tokens`: each sub-request's reservation.

    The sub-requests of a call are admitted together, each holding a concurrency slot and
    reserving its tokens in the same minute: more of them than `max_concurrency`, or more
    tokens than `tpm`, never fit, and a 429 would be retried for ever.
    """
    if limits.max_concurrency is not None and len(tokens) > limits.max_concurrency:
        return Unfit("concurrency", limits.max_concurrency, len(tokens))
    if limits.tpm is not None and sum(tokens) > limits.tpm:
        return Unfit("tokens", limits.tpm, sum(tokens))
    return None


def release(store: QuotaStore, tenant_id: str, request_id: str, attempt: int) -> bool:
    """End an admitted request that produced nothing (e.g. it was never published)."""
    return store.settle(Settlement(tenant_id, request_id, attempt, 0, 0))


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def month_of(now_ms: int) -> str:
    return dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC).strftime("%Y%m")


def ms_to_next_month(now_ms: int) -> int:
    now = dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC)
    nxt = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) + dt.timedelta(days=32)
    start = nxt.replace(day=1)
    return max(1, int(start.timestamp() * 1000) - now_ms)


def scaled(limits: PlanLimits, replicas: int) -> PlanLimits:
    """Per-process share of the rate limits for the local fallback; no budget."""

    def share(value: int | None) -> int | None:
        return value if not value else max(1, value // max(1, replicas))

    return PlanLimits(share(limits.rpm), share(limits.tpm), share(limits.max_concurrency), None)


def decision_from(
    limits: PlanLimits,
    denials: list[tuple[DenyReason, int]],
    now_us: int,
    tat_us: int,
    used_tokens: int,
    reset_tokens_ms: int,
) -> Decision:
    """Shared by both stores: the decision and header values from the state after it."""
    remaining_requests = reset_requests_s = None
    if limits.rpm:
        interval = WINDOW_MS * 1000 // limits.rpm
        remaining_requests = min(
            limits.rpm, max(0, (now_us + WINDOW_MS * 1000 - tat_us) // interval)
        )
        reset_requests_s = max(0, tat_us - now_us) / 1e6
    elif limits.rpm == 0:
        remaining_requests, reset_requests_s = 0, WINDOW_MS / 1000
    remaining_tokens = None if limits.tpm is None else max(0, limits.tpm - used_tokens)
    # a spent budget outranks every rate limit: retrying after a rate limit's wait would
    # only meet the budget again
    budget = [d for d in denials if d[0] == "budget"]
    return Decision(
        allowed=not denials,
        reason=(budget or denials)[0][0] if denials else None,
        retry_after_s=max((ms for _, ms in budget or denials), default=0) / 1000,
        limit_requests=limits.rpm,
        remaining_requests=remaining_requests,
        reset_requests_s=reset_requests_s,
        limit_tokens=limits.tpm,
        remaining_tokens=remaining_tokens,
        reset_tokens_s=None if limits.tpm is None else reset_tokens_ms / 1000,
    )
