"""What an engine worker tells the gateways of its load, on each of its heartbeats.

The gateway's SLO admission (`api.slo`) predicts a request's time to first token from
the backlog ahead of it and the rate at which the workers bring prompts to their first
token. This module measures both on the worker's event loop: the backlog is counted from
the held requests when a heartbeat is due; the rate is the prompt tokens that reached
their first token over the time a backlog waited, counted only in windows (a second or
more, closed at a heartbeat) with requests without a first token held at both ends (an
idle engine's throughput is its offered load, not its capacity), and decayed per window.
None until a backlogged window saw a first token: the gateway then refuses nothing. A
queued request also waits for a running one to end before its slot frees: the worker reports
when the first is expected to (`first_release_s`, from an EWMA of requests' decode time).
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
    @property
    def in_engine(self) -> bool: ...


class LoadMeter:
    """Prefill throughput and backlog, sampled on each heartbeat. The rate is the prompt
    tokens that reached their first token over the time a backlog waited, both summed
    over the windows (`window_s` or more) with a backlog at both ends and decayed by
    `decay` per window: first tokens come in bunches (a slot frees, the next request
    starts), so a window without any counts its time as much as one with several."""

    def __init__(
        self,
        window_s: float = 1.0,
        decay: float = 0.9,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.decay = decay
        self._clock = clock
        self._prefilled = 0  # prompt tokens that reached their first token in the window
        self._window_start = clock()
        self._backlogged = False  # a backlog waited when the window started
        self._busy_s = 0.0  # decayed sums over the backlogged windows
        self._busy_tokens = 0.0
        self.decode_s: float | None = None  # EWMA: a request's first token to its end

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self._busy_tokens / self._busy_s if self._busy_tokens > 0 else None

    def finished(self, decode_s: float) -> None:
        """A request that had its first token `decode_s` ago ended."""
        current = self.decode_s
        self.decode_s = decode_s if current is None else current + 0.3 * (decode_s - current)

    def prefilled(self, prompt_tokens: int) -> None:
        """A request got its first token."""
        self._prefilled += prompt_tokens

    def sample(
        self, items: Iterable[QueuedItem], num_running: int, now_ms: int | None = None
    ) -> WorkerLoad:
        """The load now; a window that is over adds to the rate."""
        now = self._clock()
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        tokens: dict[str, int] = {}
        requests: dict[str, int] = {}
        release_s: float | None = None
        for item in items:
            if item.first_token_ms is None:
                tokens[item.lane] = tokens.get(item.lane, 0) + item.prompt_tokens
                requests[item.lane] = requests.get(item.lane, 0) + 1
            elif item.in_engine and self.decode_s is not None:
                left_s = max(0.0, self.decode_s - (now_ms - item.first_token_ms) / 1000)
                release_s = left_s if release_s is None else min(release_s, left_s)
        elapsed = now - self._window_start
        if elapsed >= self.window_s:
            if self._backlogged and tokens:
                self._busy_s = self._busy_s * self.decay + elapsed
                self._busy_tokens = self._busy_tokens * self.decay + self._prefilled
            self._prefilled = 0
            self._window_start = now
            self._backlogged = bool(tokens)
        return WorkerLoad(
            queued_tokens=tokens,
            queued_requests=requests,
            num_running=num_running,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            first_release_s=release_s or 0.0,
        )
