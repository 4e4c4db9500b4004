"""The money suite's clients: tenants and prices through the admin API, requests through
the `openai` SDK each recorded as a `Seen`, and the settled ledger of a tenant.

Loopback only: every URL here is a server this run started.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import sqlalchemy as sa

from benchmarks.money import (
    MODEL,
    PRICE_BODY,
    LedgerRow,
    Row,
    Seen,
    Tally,
    client_visible,
    difference,
    ledger_totals,
)

ADMIN_KEY = "sk-money-admin"


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    api_key: str


class Admin:
    """`/admin/v1` of the gateway at `base_url`, and each tenant's own `/v1/usage`."""

    def __init__(self, base_url: str, database_url: str) -> None:
        self.base_url, self.database_url = base_url, database_url
        self._headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def set_price(self) -> None:
        r = httpx.put(f"{self.base_url}/admin/v1/prices", json=PRICE_BODY, headers=self._headers,
                      timeout=30)  # fmt: skip
        r.raise_for_status()

    def tenant(self, name: str) -> Tenant:
        """A new tenant (a unique name per run) with its first key."""
        body = {"name": f"{name}-{uuid.uuid4().hex[:6]}"}
        r = httpx.post(f"{self.base_url}/admin/v1/tenants", json=body, headers=self._headers,
                       timeout=30)  # fmt: skip
        r.raise_for_status()
        return Tenant(r.json()["tenant_id"], r.json()["api_key"])

    def usage(self, tenant: Tenant) -> dict[str, Any]:
        """The tenant's `/v1/usage`, asked with its own key, as the tenant sees it."""
        r = httpx.get(f"{self.base_url}/v1/usage", timeout=30,
                      headers={"Authorization": f"Bearer {tenant.api_key}"})  # fmt: skip
        r.raise_for_status()
        return dict(r.json())

    def ledger_rows(self, tenant: Tenant) -> list[LedgerRow]:
        """The tenant's ledger rows, read from the billing database (for the requests
        whose clients never saw a usage object)."""
        engine = sa.create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, "
                            "cost_picos FROM usage_ledger WHERE tenant_id = :t"),
                    {"t": tenant.tenant_id},
                ).all()  # fmt: skip
        finally:
            engine.dispose()
        return [LedgerRow(*row) for row in rows]

    def settle(
        self, scenario: str, tenant: Tenant, seen: Sequence[Seen], timeout_s: float = 30.0
    ) -> Row:
        """The scenario's row once neither side has changed for a while (1.5 s when they
        agree, 3 s when not: the billing consumer caught up) and every request the client
        saw tokens of is billed at least those, at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last: tuple[Any, ...] | None = None
        since = time.monotonic()
        while True:
            client, unseen = client_visible(seen, self.ledger_rows(tenant))
            ledger = ledger_totals(self.usage(tenant))
            now = time.monotonic()
            if (client, ledger) != last:
                last, since = (client, ledger), now
            # equal sides still wait a little: a row may be on its way to both of them
            quiet_s = 1.5 if not any(difference(client, ledger).values()) else 3.0
            # a request the client saw tokens of and the ledger has no row for yet still
            # runs: a killed gateway's streams run for its resume window before workers
            # cancel them
            waiting = bool(unseen and unseen.get("underbilled"))
            if (now - since >= quiet_s and not waiting) or now > deadline:
                return Row(scenario, client, ledger, unseen=unseen, notes=_errors(seen))
            time.sleep(0.3)


def _errors(seen: Sequence[Seen]) -> list[str]:
    errors: dict[str, int] = {}
    for s in seen:
        if s.error:
            errors[s.error[:80]] = errors.get(s.error[:80], 0) + 1
    return [f"{n} x {e}" for e, n in sorted(errors.items(), key=lambda kv: -kv[1])[:3]]


def sdk(base_url: str, api_key: str, timeout_s: float = 120.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                              timeout=timeout_s)  # fmt: skip


# -- one request -------------------------------------------------------------------------------
def chat_body(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True, **extra}  # fmt: skip


def completion_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 0, **extra}  # fmt: skip


async def call(
    client: openai.AsyncOpenAI, body: dict[str, Any], seen: Seen, hang_up_after: int | None = None
) -> Seen:
    """One chat (`messages`) or completions (`prompt`) request through the SDK; `seen`
    is filled as it goes (`received` counts streamed tokens live, by their logprobs), so a
    fault can be injected mid-stream. `hang_up_after`: close the stream once that many
    tokens arrived, before its usage."""
    api: Any = client.chat.completions if "messages" in body else client.completions
    stream = bool(body.get("stream"))
    if stream:
        body = {**body, "stream_options": {"include_usage": True}}
    try:
        raw = await api.with_raw_response.create(**body)
        seen.request_id = raw.headers.get("x-request-id")
        result = raw.parse()
        if inspect.isawaitable(result):  # a unary answer's body is read here; a stream's later
            result = await result
        if not stream:
            seen.received = sum(_logprob_count(c) for c in result.choices)
            seen.usage = result.usage.model_dump() if result.usage else None
            return seen
        async for chunk in result:
            if chunk.usage is not None:
                seen.usage = chunk.usage.model_dump()
            seen.received += sum(_logprob_count(c) for c in chunk.choices)
            if hang_up_after is not None and seen.received >= hang_up_after:
                await result.close()
                return seen
    except (openai.APIError, httpx.HTTPError) as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    return seen


def _logprob_count(choice: Any) -> int:
    logprobs = choice.logprobs
    if logprobs is None:
        return 0
    items = getattr(logprobs, "content", None) or getattr(logprobs, "tokens", None) or []
    return len(items)


async def bounded(jobs: Sequence[Callable[[], Awaitable[Any]]], concurrency: int) -> None:
    """Run `jobs`, at most `concurrency` at once."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(job) for job in jobs))


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        await asyncio.sleep(0.005)


def tally_of(seen: Sequence[Seen]) -> Tally:
    """Σ of the usage objects the clients got (the others left out)."""
    tally = Tally()
    for s in seen:
        if s.usage is not None:
            tally.add_usage(s.usage, batch=s.batch)
    return tally
