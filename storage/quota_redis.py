"""`QuotaStore` on Redis: one Lua script (one round trip) per admission and per settlement.

Keys per tenant share a hash tag, `<prefix>:{<tenant_id>}:…`, so each script touches one
cluster slot: `tat` (GCRA), `tpm:<minute>`, `leases` (zset: member → expiry ms),
`inflight` (hash: member → "tokens:window:cost"), `reserved` (estimates in flight),
`spend:<YYYYMM>` (micro-dollars) and `settled:<request_id>:<attempt>` (dedupe marker:
`1`, or `E:<tokens>:<cost>` for an estimated settlement that the attempt's own may top up).
The scripts build key names from the tenant's base key; all share its slot.

When Redis does not answer (connection refused, timeout), the policy is:
- request rate, token rate and concurrency FAIL OPEN to a local fallback limiter
  (`MemoryQuotaStore`) holding each limit divided by `fallback_replicas` (the number of
  gateway processes), so the fleet stays near the plan; decisions say `degraded=True`;
- monthly budgets FAIL CLOSED: a tenant with a budget is denied with reason
  `unavailable` (the gateway answers 503 + Retry-After) until Redis answers again;
- `settle` applies to the local fallback and raises `StoreUnavailable` (retryable), so
  the quotas consumer keeps the usage record and retries it against Redis.
After a failure Redis is not tried again for `retry_interval_s`, so an outage costs one
timeout per interval, not one per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from sluice.storage.errors import StoreUnavailable
from sluice.storage.quota_memory import MemoryQuotaStore, wall_ms
from sluice.storage.quotas import (
    DEFAULT_DEDUPE_TTL_S,
    DEFAULT_LEASE_S,
    REASONS,
    Decision,
    DenyReason,
    Reservation,
    Settlement,
    decision_from,
    month_of,
    ms_to_next_month,
    scaled,
)
from sluice.storage.tenants import PlanLimits

logger = logging.getLogger(__name__)

_COMMON = """
local base = KEYS[1]
local W = 60000
local leases = base .. ':leases'
local inflight = base .. ':inflight'
local reserved = base .. ':reserved'
"""

ADMIT = (
    _COMMON
    + """
local now = tonumber(ARGV[1])
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local conc, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens, cost, member = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local lease_ms, month, to_next_month = tonumber(ARGV[9]), ARGV[10], tonumber(ARGV[11])
for _, m in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
  local e = redis.call('HGET', inflight, m)
  if e then
    local _, _, c = string.match(e, '^(%d+):(%d+):(%d+)$')
    redis.call('DECRBY', reserved, c)
    redis.call('HDEL', inflight, m)
  end
  redis.call('ZREM', leases, m)
end
local window = math.floor(now / W)
local tkey = base .. ':tpm:' .. window
local used = tonumber(redis.call('GET', tkey) or '0')
local now_us = now * 1000
local stored_tat = tonumber(redis.call('GET', base .. ':tat') or '0')
local new_tat = math.max(stored_tat, now_us)
local out = {}
if rpm == 0 then
  table.insert(out, 1); table.insert(out, W)
elseif rpm > 0 then
  new_tat = new_tat + math.floor(W * 1000 / rpm)
  local allow_at = new_tat - W * 1000
  if now_us < allow_at then
    table.insert(out, 1); table.insert(out, math.ceil((allow_at - now_us) / 1000))
  end
end
if tpm >= 0 and used + tokens > tpm then
  table.insert(out, 2); table.insert(out, (window + 1) * W - now)
end
if conc >= 0 and redis.call('ZCARD', leases) >= conc then
  local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
  local wait = 1000
  if first[2] then wait = math.min(1000, math.max(1, tonumber(first[2]) - now)) end
  table.insert(out, 3); table.insert(out, wait)
end
if budget >= 0 then
  local spent = tonumber(redis.call('GET', base .. ':spend:' .. month) or '0')
  local held = tonumber(redis.call('GET', reserved) or '0')
  if spent + held + cost > budget then
    table.insert(out, 4); table.insert(out, to_next_month)
  end
end
if #out > 0 then
  return {0, stored_tat, used, unpack(out)}
end
if rpm > 0 then
  redis.call('SET', base .. ':tat', new_tat, 'PX', math.floor((new_tat - now_us) / 1000) + 1000)
end
used = redis.call('INCRBY', tkey, tokens)
redis.call('PEXPIRE', tkey, 2 * W)
redis.call('ZADD', leases, now + lease_ms, member)
redis.call('HSET', inflight, member, tokens .. ':' .. window .. ':' .. cost)
redis.call('INCRBY', reserved, cost)
for _, k in ipairs({leases, inflight, reserved}) do redis.call('PEXPIRE', k, lease_ms + W) end
return {1, new_tat, used}
"""
)

SETTLE = (
    _COMMON
    + """
local now, member = tonumber(ARGV[1]), ARGV[2]
local tokens, cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local month, dedupe_ms = ARGV[5], tonumber(ARGV[6])
local estimated = ARGV[7] == '1'
local marker = base .. ':settled:' .. member
local prev = redis.call('GET', marker)
if prev then
  -- settled before: only an attempt's own record after an estimate counts, and settles
  -- what it counts beyond the estimate (whose settlement already ended the reservation)
  local et, ec = string.match(prev, '^E:(%d+):(%d+)$')
  if estimated or not et then return 0 end
  redis.call('SET', marker, '1', 'KEEPTTL')
  tokens, cost = tokens - tonumber(et), cost - tonumber(ec)
else
  redis.call('SET', marker, estimated and ('E:' .. tokens .. ':' .. cost) or '1', 'PX', dedupe_ms)
end
local e = redis.call('HGET', inflight, member)
if e then
  local t, w, c = string.match(e, '^(%d+):(%d+):(%d+)$')
  redis.call('HDEL', inflight, member)
  redis.call('ZREM', leases, member)
  local tkey = base .. ':tpm:' .. w
  if redis.call('EXISTS', tkey) == 1 then redis.call('INCRBY', tkey, tokens - tonumber(t)) end
  redis.call('DECRBY', reserved, c)
else
  local tkey = base .. ':tpm:' .. math.floor(now / W)
  redis.call('INCRBY', tkey, tokens)
  redis.call('PEXPIRE', tkey, 2 * W)
end
local skey = base .. ':spend:' .. month
redis.call('INCRBY', skey, cost)
redis.call('EXPIRE', skey, 40 * 86400)
return 1
"""
)

_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
UNAVAILABLE_RETRY_S = 5.0


class RedisQuotaStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "sluice:quota",
        lease_s: float = DEFAULT_LEASE_S,
        dedupe_ttl_s: float = DEFAULT_DEDUPE_TTL_S,
        fallback_replicas: int = 1,
        timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.dedupe_ttl_ms = int(dedupe_ttl_s * 1000)
        self.fallback_replicas = fallback_replicas
        self.retry_interval_s = retry_interval_s
        self.fallback = MemoryQuotaStore(
            lease_s=lease_s, dedupe_ttl_s=dedupe_ttl_s, clock_ms=clock_ms
        )
        self._clock_ms = clock_ms
        self._admit = self.client.register_script(ADMIT)
        self._settle = self.client.register_script(SETTLE)
        self._down_until = 0.0

    def base(self, tenant_id: str) -> str:
        return f"{self.prefix}:{{{tenant_id}}}"

    def admit(self, limits: PlanLimits, reservation: Reservation) -> Decision:
        if time.monotonic() < self._down_until:
            return self._degraded(limits, reservation)
        r = reservation
        now = self._clock_ms()
        args: list[int | str] = [now, *(_arg(v) for v in _limit_values(limits))]
        args += [r.tokens, r.cost_micros]
        args += [r.member, self.lease_ms, month_of(now), ms_to_next_month(now)]
        try:
            reply = self._admit(keys=[self.base(r.tenant_id)], args=args)
        except _UNREACHABLE as exc:
            self._mark_down(exc)
            return self._degraded(limits, reservation)
        _, tat_us, used, *flat = (int(v) for v in reply)
        denials: list[tuple[DenyReason, int]] = [
            (REASONS[flat[i] - 1], flat[i + 1]) for i in range(0, len(flat), 2)
        ]
        reset_tokens_ms = (now // 60_000 + 1) * 60_000 - now
        return decision_from(limits, denials, now * 1000, tat_us, used, reset_tokens_ms)

    def settle(self, settlement: Settlement) -> bool:
        s = settlement
        if time.monotonic() < self._down_until:
            self.fallback.settle(s)
            raise StoreUnavailable("Redis quota store unavailable; settlement will be retried")
        now = self._clock_ms()
        args = [now, s.member, s.tokens, s.cost_micros, month_of(now), self.dedupe_ttl_ms]
        args.append(int(s.estimated))
        try:
            return bool(self._settle(keys=[self.base(s.tenant_id)], args=args))
        except _UNREACHABLE as exc:
            self._mark_down(exc)
            self.fallback.settle(s)
            raise StoreUnavailable(f"Redis quota store unavailable: {exc}") from exc

    def _degraded(self, limits: PlanLimits, reservation: Reservation) -> Decision:
        if limits.monthly_budget_micros is not None:
            return Decision(False, "unavailable", UNAVAILABLE_RETRY_S, degraded=True)
        local = self.fallback.admit(scaled(limits, self.fallback_replicas), reservation)
        return Decision(
            local.allowed, local.reason, local.retry_after_s,
            local.limit_requests, local.remaining_requests, local.reset_requests_s,
            local.limit_tokens, local.remaining_tokens, local.reset_tokens_s,
            degraded=True,
        )  # fmt: skip

    def _mark_down(self, exc: Exception) -> None:
        logger.warning(
            "Redis quota store unreachable (%s): rate limits fail open with a local cap, "
            "budgets fail closed, for the next %.1fs",
            exc,
            self.retry_interval_s,
        )
        self._down_until = time.monotonic() + self.retry_interval_s

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except _UNREACHABLE:
            return False

    def close(self) -> None:
        self.client.close()


def _limit_values(limits: PlanLimits) -> tuple[int | None, ...]:
    return (limits.rpm, limits.tpm, limits.max_concurrency, limits.monthly_budget_micros)


def _arg(value: int | None) -> int:
    return -1 if value is None else value
