"""Deterministic usage records for ledger, consumer and report tests."""

from __future__ import annotations

import random

from sluice.bus.messages import Timings, UsageRecord
from sluice.bus.topics import Lane

DAY_MS = 86_400_000
START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def make_usages(n: int, *, tenants: tuple[str, ...] = ("ten_a", "ten_b"), seed: int = 7,
                days: int = 3) -> list[UsageRecord]:  # fmt: skip
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(1, 2000)
        lane = rng.choice([Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH])
        finished = START_MS + rng.randrange(days) * DAY_MS + rng.randrange(DAY_MS)
        out.append(
            UsageRecord(
                request_id=f"req-{i:04d}",
                attempt=rng.choice([0, 0, 0, 1]),
                tenant_id=tenants[i % len(tenants)],
                key_id=f"key-{i % 3}",
                model=rng.choice(["llama-small", "llama-large", "unpriced-model"]),
                lane=lane,
                prompt_tokens=prompt,
                cached_tokens=rng.randint(0, prompt),
                completion_tokens=rng.randint(0, 500),
                finish_reason=rng.choice(["stop", "length", "abort"]),
                timings=Timings(
                    queued_ms=finished - 900,
                    scheduled_ms=finished - 800,
                    first_token_ms=finished - 500,
                    finished_ms=finished,
                ),
                batch_id="batch_1" if lane == Lane.BATCH else None,
            )
        )
    return out
