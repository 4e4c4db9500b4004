"""What an engine worker tells the gateways of its load, on each of its heartbeats.

The gateway's SLO admission (`api.slo`) predicts a request's time to first token from
the backlog ahead of it and the rate at which the workers bring prompts to their first
token. This module measures both on the worker's event loop: the backlog is counted from
the held requests when a heartbeat is due; the rate is the prompt tokens that reached
their first token since the last heartbeat over the time between, kept as an EWMA and
updated only when requests without a first token were held at both ends of the interval
(an idle engine's throughput is its offered load, not its capacity), or when a sample
beats the estimate (a lower bound of the capacity either way). None until a backlogged
interval was measured: the gateway then refuses nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from sluice.bus.messages import WorkerLoad


class QueuedItem(Protocol):
    """What the meter reads of a held request (`consumers.work_item.WorkItem`)."""

    @property
    def lane(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def first_token_ms(self) -> int | None: ...


class LoadMeter:
    """Prefill throughput (EWMA) and backlog, sampled once per heartbeat."""

    def __init__(self, alpha: float = 0.3, clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self._clock = clock
        self._prefilled = 0  # prompt tokens that reached their first token since the sample
        self._sampled_at = clock()
        self._backlogged = False  # a backlog waited at the last sample
        self.prefill_tokens_per_s: float | None = None

    def prefilled(self, prompt_tokens: int) -> None:
        """A request got its first token."""
        self._prefilled += prompt_tokens

    def sample(self, items: Iterable[QueuedItem], num_running: int) -> WorkerLoad:
        """The load now; updates the rate from the interval since the last sample."""
        now = self._clock()
        tokens: dict[str, int] = {}
        requests: dict[str, int] = {}
        for item in items:
            if item.first_token_ms is None:
                tokens[item.lane] = tokens.get(item.lane, 0) + item.prompt_tokens
                requests[item.lane] = requests.get(item.lane, 0) + 1
        elapsed = now - self._sampled_at
        backlogged = self._backlogged and bool(tokens)  # at both ends of the interval
        if elapsed > 0 and self._prefilled > 0:
            rate = self._prefilled / elapsed
            current = self.prefill_tokens_per_s
            if current is None:
                if backlogged:
                    self.prefill_tokens_per_s = rate
            elif backlogged or rate > current:
                self.prefill_tokens_per_s = current + self.alpha * (rate - current)
        self._prefilled = 0
        self._sampled_at = now
        self._backlogged = bool(tokens)
        return WorkerLoad(
            queued_tokens=tokens,
            queued_requests=requests,
            num_running=num_running,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )
