"""SLO-aware admission: refuse a request before publishing when it would miss its lane's
time-to-first-token target.

Sits in the gateway between screening and quota admission (`api.deps.Gateway.submit`).
The prediction, for a request of lane L with P prompt tokens:

    ttft ≈ (tokens ahead + P) / prefill rate  [+ first release, when tokens are ahead]

- tokens ahead: prompt tokens without a first token yet in L and the more urgent lanes
  (the workers' fair queues and engines serve those first). Two views, the larger wins:
  the sum the workers reported on their last heartbeats (`bus.messages.WorkerLoad`,
  every gateway's work), and this gateway's own published requests still waiting for a
  first token (exact, and fresh between heartbeats). Not their sum: a heartbeat already
  holds most of what this gateway published before it.
- prefill rate: the sum of the fresh workers' measured rates (`consumers.worker_load`:
  prompt tokens brought to their first token per second under a backlog). It already
  pays for the decode steps that share the engine with the prefills.
- first release: while requests wait ahead, the engine's slots are full, and the first
  one frees when a running request ends; the rate counts the releases after it at their
  average pace. The workers report when their first running request is expected to end
  (the mean over the fresh workers is used). After a burst every slot started at once
  and frees at once, which the rate alone would miss.

Nothing is refused while no worker has reported a rate (a cold fleet), or when no worker
was heard for three heartbeat intervals (the engine-down paths answer then), or for a
lane without a target (batch/flex). A refusal is a 429 `server_overloaded` whose
`retry-after` is the time the backlog needs to drain to the target. The prediction's
error (actual minus predicted, at the request's first token) is the
`sluice_ttft_prediction_error_seconds` histogram.

Heartbeats arrive on the reply consumer's thread (`heard`); everything else runs on the
event loop. `heard` builds one aggregate and swaps it in with a single assignment, so a
prediction reads a consistent snapshot in O(lanes), without a lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sluice.api.errors import ServerOverloaded
from sluice.bus.messages import GenerateRequest, Heartbeat, TokenDelta, WorkerLoad
from sluice.bus.topics import Lane
from sluice.tracing.metrics import count_slo_refusal, observe_ttft_prediction_error

LANES = tuple(lane.value for lane in Lane)  # most urgent first
STALE_AFTER_BEATS = 3  # a worker not heard for this many intervals is left out
PENDING_TTL_S = 120.0  # a request with no first token this long stops counting as ahead


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The fresh workers' load summed, as of `at` (monotonic seconds)."""

    at: float
    stale_after_s: float
    ahead_tokens: tuple[int, ...]  # per lane index: tokens queued in it and above
    prefill_tokens_per_s: float | None
    first_release_s: float = 0.0


@dataclass(slots=True)
class _Pending:
    lane: int
    tokens: int
    predicted_s: float | None
    published_at: float


class SloAdmission:
    """Predicts TTFT per lane and refuses what would miss its target; see the module doc.

    targets_s: lane name → TTFT target in seconds; a lane left out is never refused.
    """

    def __init__(
        self, targets_s: Mapping[str, float], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.targets_s = dict(targets_s)
        self._clock = clock
        self._workers: dict[str, tuple[float, float, WorkerLoad]] = {}  # id → at, interval
        self.fleet: FleetLoad | None = None
        self._pending: dict[str, _Pending] = {}
        self._own_ahead = [0] * len(LANES)  # per lane index: this gateway's unstarted tokens
        self._swept_at = clock()

    # -- heartbeats (the reply consumer's thread) --------------------------------------
    def heard(self, beat: Heartbeat) -> None:
        if beat.role != "worker" or beat.load is None:
            return
        now = self._clock()
        interval_s = max(beat.interval_ms / 1000, 0.001)
        self._workers[beat.sender_id] = (now, interval_s, beat.load)
        ahead = [0] * len(LANES)
        rates: list[float] = []
        releases: list[float] = []
        stale_after_s = 0.0
        for worker_id, (at, interval, load) in list(self._workers.items()):
            if now - at > STALE_AFTER_BEATS * interval:
                del self._workers[worker_id]
                continue
            stale_after_s = max(stale_after_s, STALE_AFTER_BEATS * interval)
            for lane, tokens in load.queued_tokens.items():
                if lane in LANES:
                    ahead[LANES.index(lane)] += tokens
            if load.prefill_tokens_per_s:
                rates.append(load.prefill_tokens_per_s)
            releases.append(load.first_release_s)
        for i in range(1, len(ahead)):
            ahead[i] += ahead[i - 1]
        rate = sum(rates) if rates else None
        release_s = sum(releases) / len(releases) if releases else 0.0
        self.fleet = FleetLoad(now, stale_after_s, tuple(ahead), rate, release_s)

    # -- the prediction and the decision (the event loop) ------------------------------
    def predict(self, lane: str, prompt_tokens: int) -> float | None:
        """Seconds to the first token of a new request; None: no basis to predict."""
        fleet = self.fleet
        if fleet is None or not fleet.prefill_tokens_per_s:
            return None
        if self._clock() - fleet.at > fleet.stale_after_s:
            return None
        index = LANES.index(lane)
        own = sum(self._own_ahead[: index + 1])
        ahead = max(fleet.ahead_tokens[index], own)
        wait_s = fleet.first_release_s if ahead else 0.0
        return wait_s + (ahead + prompt_tokens) / fleet.prefill_tokens_per_s

    def check(self, requests: Sequence[GenerateRequest]) -> None:
        """Raise ServerOverloaded when the call would miss its lane's TTFT target."""
        if not requests:
            return
        lane = requests[0].lane.value
        target_s = self.targets_s.get(lane)
        if target_s is None:
            return
        predicted_s = self.predict(lane, sum(len(r.prompt_token_ids) for r in requests))
        if predicted_s is None or predicted_s <= target_s:
            return
        count_slo_refusal(lane, len(requests))
        raise ServerOverloaded(
            f"the {lane} lane is overloaded: the first token would come after about"
            f" {predicted_s:.1f}s, past its target of {target_s:g}s; retry later",
            retry_after_s=max(1, math.ceil(predicted_s - target_s)),
        )

    def published(self, requests: Sequence[GenerateRequest]) -> None:
        """These requests are on their way: they count as ahead until their first token."""
        now = self._clock()
        if now - self._swept_at > PENDING_TTL_S / 4:
            self._sweep(now)
        for request in requests:
            lane, tokens = LANES.index(request.lane.value), len(request.prompt_token_ids)
            predicted = self.predict(request.lane.value, tokens)
            self._pending[request.request_id] = _Pending(lane, tokens, predicted, now)
            self._own_ahead[lane] += tokens

    def on_delta(self, delta: TokenDelta) -> None:
        """A delta reached this gateway: a first token ends its request's wait."""
        if not (delta.token_ids or delta.finish_reason) or not self._pending:
            return
        pending = self._forget(delta.request_id)
        if pending is not None and delta.token_ids and pending.predicted_s is not None:
            actual_s = self._clock() - pending.published_at
            observe_ttft_prediction_error(LANES[pending.lane], actual_s - pending.predicted_s)

    def forget(self, request_id: str) -> None:
        """The request was cancelled or never published."""
        self._forget(request_id)

    def _forget(self, request_id: str) -> _Pending | None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._own_ahead[pending.lane] -= pending.tokens
        return pending

    def _sweep(self, now: float) -> None:
        """Requests whose first token never came (lost on the way) stop counting."""
        self._swept_at = now
        for request_id, pending in list(self._pending.items()):
            if now - pending.published_at > PENDING_TTL_S:
                self._forget(request_id)
