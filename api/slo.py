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
  and frees at once, which the rate alone would miss. Heartbeats lag a burst, so the
  gateway also keeps its own view: when its oldest running request (first token seen,
  no end yet) should end, by the mean time its requests decode (an EWMA); the later of
  the two is used.

The decision adds a margin to the prediction: a running estimate of the 99th percentile
of how late first tokens came against their predictions, per lane (a stochastic
quantile step per observation, never below 0), so a predictor that runs short in this
deployment refuses earlier rather than letting the lane's tail past its target.

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
from sluice.bus.topics import Lane, pool_id
from sluice.tracing.metrics import count_slo_refusal, observe_ttft_prediction_error

LANES = tuple(lane.value for lane in Lane)  # most urgent first
STALE_AFTER_BEATS = 3  # a worker not heard for this many intervals is left out
PENDING_TTL_S = 120.0  # a request with no first token this long stops counting as ahead
MARGIN_QUANTILE = 0.99  # of the lateness (actual - predicted) the margin tracks
MARGIN_STEP_S = 0.05  # how far one observation moves the margin


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
        self._margin_s = [0.0] * len(LANES)  # per lane index: see the module docstring
        # this gateway's requests past their first token, oldest first → when it came
        self._running: dict[str, float] = {}
        self._decode_s: float | None = None  # EWMA: first token to the end
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
        wait_s = max(fleet.first_release_s, self._own_release_s()) if ahead else 0.0
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
        if predicted_s is None:
            return
        predicted_s += self.margin_s(lane)
        if predicted_s <= target_s:
            return
        count_slo_refusal(lane, len(requests))
        raise ServerOverloaded(
            f"the {lane} lane is overloaded: the first token would come after about"
            f" {predicted_s:.1f}s, past its target of {target_s:g}s; retry later",
            retry_after_s=max(1, math.ceil(predicted_s - target_s)),
        )

    def margin_s(self, lane: str) -> float:
        """What the decision adds to this lane's predictions."""
        return self._margin_s[LANES.index(lane)]

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

    def _own_release_s(self) -> float:
        """When this gateway's oldest running request should end (0: none, or unknown)."""
        if not self._running or self._decode_s is None:
            return 0.0
        oldest = next(iter(self._running.values()))
        return max(0.0, self._decode_s - (self._clock() - oldest))

    def on_delta(self, delta: TokenDelta) -> None:
        """A delta reached this gateway: a first token ends its request's wait, a last
        one its decode."""
        if delta.finish_reason and self._running:
            started = self._running.pop(delta.request_id, None)
            if started is not None:
                decode_s = self._clock() - started
                current = self._decode_s
                self._decode_s = (
                    decode_s if current is None else current + 0.2 * (decode_s - current)
                )
        if not (delta.token_ids or delta.finish_reason) or not self._pending:
            return
        pending = self._forget(delta.request_id)
        if pending is not None and delta.token_ids and not delta.finish_reason:
            self._running[delta.request_id] = self._clock()
        if pending is not None and delta.token_ids and pending.predicted_s is not None:
            error_s = self._clock() - pending.published_at - pending.predicted_s
            observe_ttft_prediction_error(LANES[pending.lane], error_s)
            margin = self._margin_s[pending.lane]
            step = MARGIN_QUANTILE if error_s > margin else MARGIN_QUANTILE - 1
            self._margin_s[pending.lane] = max(0.0, margin + MARGIN_STEP_S * step)

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
        for request_id, started in list(self._running.items()):
            if now - started > PENDING_TTL_S:
                del self._running[request_id]


class SloPools:
    """One `SloAdmission` per model pool: a pool's workers report its load and its
    requests wait in its own topics, so each is predicted from its own beats alone."""

    def __init__(
        self,
        targets_s: Mapping[str, float],
        pools: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # built up front: heartbeats arrive on another thread, so the dict never changes
        self.pools = {pool: SloAdmission(targets_s, clock) for pool in pools}

    def of(self, request: GenerateRequest) -> SloAdmission | None:
        return self.pools.get(pool_id(request.model))

    def heard(self, beat: Heartbeat) -> None:
        admission = self.pools.get(beat.pool or "") if beat.role == "worker" else None
        if admission is not None:
            admission.heard(beat)

    def check(self, requests: Sequence[GenerateRequest]) -> None:
        admission = self.of(requests[0]) if requests else None
        if admission is not None:
            admission.check(requests)

    def published(self, requests: Sequence[GenerateRequest]) -> None:
        admission = self.of(requests[0]) if requests else None
        if admission is not None:
            admission.published(requests)

    def on_delta(self, delta: TokenDelta) -> None:
        for admission in self.pools.values():
            admission.on_delta(delta)

    def forget(self, request_id: str) -> None:
        for admission in self.pools.values():
            admission.forget(request_id)
