"""In-process `QuotaStore` for embedded mode (and the Redis store's outage fallback).

The same algorithm as the Lua scripts in `quota_redis.py`, under one lock; the shared
contract suite holds both to the same numbers. Counts only this process's traffic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.storage.quotas import (
    DEFAULT_DEDUPE_TTL_S,
    DEFAULT_LEASE_S,
    WINDOW_MS,
    Decision,
    DenyReason,
    Reservation,
    Settlement,
    decision_from,
    month_of,
    ms_to_next_month,
)
from sluice.storage.tenants import PlanLimits


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class _Inflight:
    tokens: int
    window: int
    cost_micros: int
    expires_ms: int


@dataclass(frozen=True, slots=True)
class _Settled:
    expires_ms: int
    estimate: tuple[int, int] | None = None  # (tokens, cost) of an estimated settlement


@dataclass(slots=True)
class _Tenant:
    tat_us: int = 0  # GCRA theoretical arrival time
    tokens: dict[int, int] = field(default_factory=dict)  # minute window -> tokens
    inflight: dict[str, _Inflight] = field(default_factory=dict)
    reserved_micros: int = 0
    spend: dict[str, int] = field(default_factory=dict)  # YYYYMM -> micro-dollars


class MemoryQuotaStore:
    def __init__(
        self,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        dedupe_ttl_s: float = DEFAULT_DEDUPE_TTL_S,
        clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        self.lease_ms = int(lease_s * 1000)
        self.dedupe_ttl_ms = int(dedupe_ttl_s * 1000)
        self._clock_ms = clock_ms
        self._tenants: dict[str, _Tenant] = {}
        self._settled: dict[str, _Settled] = {}  # tenant + member -> dedupe entry
        self._lock = threading.Lock()

    def admit(self, limits: PlanLimits, reservation: Reservation) -> Decision:
        with self._lock:
            now = self._clock_ms()
            state = self._tenants.setdefault(reservation.tenant_id, _Tenant())
            self._purge(state, now)
            return self._admit(state, limits, reservation, now)

    def _admit(self, state: _Tenant, limits: PlanLimits, r: Reservation, now: int) -> Decision:
        window = now // WINDOW_MS
        reset_tokens_ms = (window + 1) * WINDOW_MS - now
        used = state.tokens.get(window, 0)
        denials: list[tuple[DenyReason, int]] = []
        now_us = now * 1000
        tat = max(state.tat_us, now_us)
        new_tat = tat
        if limits.rpm is not None:
            if limits.rpm == 0:
                denials.append(("requests", WINDOW_MS))
            else:
                interval = WINDOW_MS * 1000 // limits.rpm
                new_tat = tat + interval
                allow_at = new_tat - WINDOW_MS * 1000
                if now_us < allow_at:
                    denials.append(("requests", -(-(allow_at - now_us) // 1000)))
        if limits.tpm is not None and used + r.tokens > limits.tpm:
            denials.append(("tokens", reset_tokens_ms))
        if limits.max_concurrency is not None and len(state.inflight) >= limits.max_concurrency:
            soonest = min((e.expires_ms for e in state.inflight.values()), default=now + 1000)
            denials.append(("concurrency", min(1000, max(1, soonest - now))))
        budget = limits.monthly_budget_micros
        spent = state.spend.get(month_of(now), 0)
        if budget is not None and spent + state.reserved_micros + r.cost_micros > budget:
            denials.append(("budget", ms_to_next_month(now)))
        allowed = not denials
        if allowed:
            state.tat_us = new_tat
            used += r.tokens
            state.tokens[window] = used
            state.inflight[r.member] = _Inflight(
                r.tokens, window, r.cost_micros, now + self.lease_ms
            )
            state.reserved_micros += r.cost_micros
        return decision_from(limits, denials, now_us, state.tat_us, used, reset_tokens_ms)

    def settle(self, settlement: Settlement) -> bool:
        s = settlement
        with self._lock:
            now = self._clock_ms()
            key = f"{s.tenant_id}\x00{s.member}"
            tokens, cost = s.tokens, s.cost_micros
            settled = self._settled.get(key)
            if settled is not None and settled.expires_ms > now:
                if s.estimated or settled.estimate is None:
                    return False
                # the attempt's own record after an estimate: it settles what it counts
                # beyond the estimate (whose settlement already ended the reservation)
                tokens, cost = tokens - settled.estimate[0], cost - settled.estimate[1]
                self._settled[key] = _Settled(settled.expires_ms)
            else:
                estimate = (tokens, cost) if s.estimated else None
                self._settled[key] = _Settled(now + self.dedupe_ttl_ms, estimate)
            state = self._tenants.setdefault(s.tenant_id, _Tenant())
            entry = state.inflight.pop(s.member, None)
            if entry is not None:
                if entry.window in state.tokens:
                    state.tokens[entry.window] += tokens - entry.tokens
                state.reserved_micros -= entry.cost_micros
            else:
                window = now // WINDOW_MS
                state.tokens[window] = state.tokens.get(window, 0) + tokens
            month = month_of(now)
            state.spend[month] = state.spend.get(month, 0) + cost
            if len(self._settled) > 100_000:
                self._settled = {k: v for k, v in self._settled.items() if v.expires_ms > now}
            return True

    def _purge(self, state: _Tenant, now: int) -> None:
        for member, entry in list(state.inflight.items()):
            if entry.expires_ms <= now:
                del state.inflight[member]
                state.reserved_micros -= entry.cost_micros
        current = now // WINDOW_MS
        for window in [w for w in state.tokens if w < current - 1]:
            del state.tokens[window]

    def close(self) -> None:
        pass
