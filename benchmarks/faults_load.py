"""The fault runs' clients: mixed requests, each classified by what its client saw.

Every request asks for exactly `max_tokens` tokens (`ignore_eos`, greedy) with logprobs,
so the client counts the tokens it was given one by one: more than asked is a duplicate,
fewer on a finished request a gap. A request ends as one of:

- completed: a finish reason arrived (`length`);
- failed: the client was told, by an OpenAI error object (HTTP or in the stream) or by
  its connection failing (refused, reset, a stream cut short);
- cancelled: the client hung up on purpose after a few tokens;
- lost: no answer within the client's timeout, or a stream that ended cleanly without a
  finish reason or an error.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

KINDS = ("stream", "unary", "cancel")
PROMPTS = [f"Fault run story {i}: once upon a time" for i in range(16)]


@dataclass(slots=True)
class Outcome:
    kind: str
    request_id: str | None = None
    status: str = "lost"  # completed | failed | cancelled | lost
    tokens: int = 0  # tokens the client was given
    usage_tokens: int | None = None  # completion tokens the gateway reported
    usage_prompt_tokens: int | None = None  # and prompt tokens (None: no usage object came)
    error: str | None = None


@dataclass(slots=True)
class Load:
    """`total` requests, at most `concurrency` in flight, kinds mixed in a seeded order."""

    base_url: str
    api_key: str
    total: int = 1000
    concurrency: int = 24
    max_tokens: int = 16
    timeout_s: float = 120.0
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def done(self) -> int:
        return len(self.outcomes)

    async def run(
        self,
        on_progress: Callable[[int], None] | None = None,
        more: Callable[[], bool] | None = None,
    ) -> list[Outcome]:
        """Send `total` requests, and more after those while `more()` says so (a fault
        still being injected), so the load outlasts the fault."""
        rng = random.Random(self.seed)
        sent = 0

        def take() -> tuple[int, str] | None:
            nonlocal sent
            if sent >= self.total and (more is None or not more()):
                return None
            sent += 1
            return sent - 1, rng.choices(KINDS, weights=(4, 4, 2))[0]

        limits = httpx.Limits(max_connections=self.concurrency * 2)
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                     limits=limits) as client:  # fmt: skip

            async def worker() -> None:
                while (item := take()) is not None:
                    i, kind = item
                    self.outcomes.append(await self._one(client, i, kind))
                    if on_progress is not None:
                        on_progress(self.done)

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return self.outcomes

    async def _one(self, client: httpx.AsyncClient, i: int, kind: str) -> Outcome:
        outcome = Outcome(kind)
        try:
            async with asyncio.timeout(self.timeout_s):
                if kind == "unary":
                    await self._unary(client, i, outcome)
                else:
                    await self._stream(client, i, outcome, cancel_after=kind == "cancel")
        except TimeoutError:
            outcome.status, outcome.error = "lost", "no answer in time"
        except httpx.HTTPError as exc:  # refused, reset, cut short: the client knows
            outcome.status, outcome.error = "failed", f"{type(exc).__name__}: {exc}"
        return outcome

    def _body(self) -> dict[str, Any]:
        return {
            "model": "tiny-llama",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }

    async def _unary(self, client: httpx.AsyncClient, i: int, outcome: Outcome) -> None:
        body = {**self._body(), "prompt": PROMPTS[i % len(PROMPTS)], "logprobs": 0}
        r = await client.post("/v1/completions", json=body, timeout=self.timeout_s)
        outcome.request_id = r.headers.get("x-request-id")
        payload = r.json()
        if r.status_code != 200:
            outcome.status, outcome.error = "failed", _error_text(payload, r.status_code)
            return
        choice = payload["choices"][0]
        outcome.tokens = len(choice["logprobs"]["tokens"])
        outcome.usage_tokens = payload["usage"]["completion_tokens"]
        outcome.usage_prompt_tokens = payload["usage"]["prompt_tokens"]
        outcome.status = "completed" if choice.get("finish_reason") else "lost"

    async def _stream(
        self, client: httpx.AsyncClient, i: int, outcome: Outcome, cancel_after: bool
    ) -> None:
        body = {
            **self._body(),
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 timeout=self.timeout_s) as r:  # fmt: skip
            outcome.request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                payload = json.loads(await r.aread())
                outcome.status, outcome.error = "failed", _error_text(payload, r.status_code)
                return
            finished = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.status, outcome.error = "failed", _error_text(chunk, 200)
                    return
                if chunk.get("usage"):
                    outcome.usage_tokens = chunk["usage"]["completion_tokens"]
                    outcome.usage_prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    outcome.tokens += len((choice.get("logprobs") or {}).get("content") or [])
                    finished = finished or choice.get("finish_reason") is not None
                if cancel_after and outcome.tokens >= self.max_tokens // 3:
                    outcome.status = "cancelled"
                    return  # leaving the block hangs up
            outcome.status = "completed" if finished else "lost"


def _error_text(payload: Any, status: int) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return f"{status} {error.get('code')}: {error.get('message')}"
    return f"{status} without an error object"


def summarize(outcomes: list[Outcome], max_tokens: int) -> dict[str, Any]:
    """The client side of one row: counts by status, and token mismatches."""
    statuses = Counter(o.status for o in outcomes)
    completed = [o for o in outcomes if o.status == "completed"]
    duplicated = sum(max(0, o.tokens - max_tokens) for o in completed)
    missing = sum(max(0, max_tokens - o.tokens) for o in completed)
    # a stream that hung up keeps what it got; more than asked is a duplicate there too
    duplicated += sum(max(0, o.tokens - max_tokens) for o in outcomes if o.status != "completed")
    misreported = sum(1 for o in completed if o.usage_tokens not in (None, o.tokens))
    errors = Counter((o.error or "")[:80] for o in outcomes if o.status in ("failed", "lost"))
    return {
        "sent": len(outcomes),
        "completed": statuses["completed"],
        "cancelled": statuses["cancelled"],
        "failed_clear": statuses["failed"],
        "lost": statuses["lost"],
        "duplicated_tokens": duplicated,
        "missing_tokens": missing,
        "usage_mismatches": misreported,
        "errors": dict(errors.most_common(5)),
    }


def run_load(
    load: Load,
    on_progress: Callable[[int], None] | None = None,
    more: Callable[[], bool] | None = None,
) -> float:
    """Run `load` to the end on a fresh event loop; the seconds it took."""
    start = time.monotonic()
    asyncio.run(load.run(on_progress, more))
    return time.monotonic() - start
