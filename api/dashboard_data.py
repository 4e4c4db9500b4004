"""The live dashboard's pipeline numbers, from the Prometheus text of this process and its peers.

`/dashboard/data` (api/routes/dashboard.py) scrapes this process's registry and each URL of
`SLUICE_METRICS_PEERS` on every poll and keeps the scrapes of the last minutes in a
`ScrapeHistory`. Gauges are read from the newest scrape. Rates and percentiles come from
differences between scrapes, per source, summed over the sources: a source whose counters
went down restarted (counted from 0); one not scraped at the older poll (a peer that was
down) adds nothing, rather than its whole history at once:

- tokens/s: generated-token counter delta between the newest scrape and the one a poll
  (at least 1.5 s) before it, over their time apart;
- TTFT and ITL p50/p99: the histogram bucket counts of the newest scrape minus those of the
  oldest scrape kept (at most `window_s` old), summed, then Prometheus' own
  `histogram_quantile` interpolation. With one scrape only, or no observation in the
  window, the counts since each process started are used instead (`since_start`), so a
  page opened after the traffic still shows what it was.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.bus.topics import Lane, parse_request_topic

logger = logging.getLogger(__name__)

GENERATION_TOKENS = "vllm:generation_tokens_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CONSUMER_LAG = "sluice_consumer_lag_records"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
HISTOGRAMS = (TTFT, ITL)
SELF = "self"
# Several open pages poll the same history: a rate over two polls a few ms apart is noise.
RATE_MIN_S = 1.5


@dataclass(frozen=True, slots=True)
class Scrape:
    """One source's metrics at one poll, summed over every label set we do not split by."""

    sums: dict[str, float] = field(default_factory=dict)  # sample name -> sum
    maxes: dict[str, float] = field(default_factory=dict)  # sample name -> max
    lag_by_topic: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> n


def parse_scrape(text: str) -> Scrape:
    """A `Scrape` from Prometheus text exposition (raises ValueError on malformed text)."""
    scrape = Scrape()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if math.isnan(value) or name.endswith("_created"):
                continue
            if name.endswith("_bucket") and "le" in sample.labels:
                per_le = scrape.buckets.setdefault(name.removesuffix("_bucket"), {})
                le = float(sample.labels["le"])
                per_le[le] = per_le.get(le, 0.0) + value
                continue
            scrape.sums[name] = scrape.sums.get(name, 0.0) + value
            scrape.maxes[name] = max(scrape.maxes.get(name, value), value)
            if name == CONSUMER_LAG:
                topic = sample.labels.get("topic", "")
                scrape.lag_by_topic[topic] = scrape.lag_by_topic.get(topic, 0.0) + value
    return scrape


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative bucket counts (le -> count).

    Linear interpolation inside the bucket that holds the rank; the lower bound of the
    first bucket is 0; a rank in the +Inf bucket answers the highest finite bound.
    None without observations.
    """
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower if len(bounds) > 1 else None
            if le <= 0 or count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return None


def _delta(new: float, old: float | None) -> float:
    """A counter's increase; a lower value means its process restarted (count from 0)."""
    if old is None or new < old:
        return new
    return new - old


@dataclass(frozen=True, slots=True)
class _Poll:
    t_s: float
    scrapes: dict[str, Scrape]


class ScrapeHistory:
    """The scrapes of the last `window_s` seconds, one entry per poll (bounded)."""

    def __init__(self, window_s: float = 300.0, max_polls: int = 600) -> None:
        self.window_s = window_s
        self._polls: deque[_Poll] = deque(maxlen=max_polls)

    def add(self, t_s: float, scrapes: Mapping[str, Scrape]) -> None:
        self._polls.append(_Poll(t_s, dict(scrapes)))
        while self._polls and self._polls[0].t_s < t_s - self.window_s:
            self._polls.popleft()

    def summary(self) -> dict[str, Any]:
        """The dashboard's pipeline numbers from the polls kept (empty before the first)."""
        if not self._polls:
            return {}
        newest = self._polls[-1]
        gauges = list(newest.scrapes.values())
        kv = [s.maxes[KV_USAGE] for s in gauges if KV_USAGE in s.maxes]
        return {
            "queue_depth": queue_depth(gauges),
            "lag_by_topic": _merged_lag(gauges),
            "requests": {
                "running": _sum(gauges, RUNNING),
                "waiting": _sum(gauges, WAITING),
            },
            "kv_cache_usage": max(kv) if kv else None,
            "tokens_per_s": self._rate(GENERATION_TOKENS),
            "generated_tokens": _sum(gauges, GENERATION_TOKENS),
            "latency": self._latency(),
        }

    def _rate(self, name: str) -> float | None:
        """Per second since the newest poll at least `RATE_MIN_S` older than the newest
        one (else the oldest kept); None before there are two polls."""
        if len(self._polls) < 2:
            return None
        new = self._polls[-1]
        old = next(
            (p for p in reversed(self._polls) if p.t_s <= new.t_s - RATE_MIN_S), self._polls[0]
        )
        elapsed = new.t_s - old.t_s
        if elapsed <= 0:
            return None
        total = 0.0
        for source, scrape in new.scrapes.items():
            if name not in scrape.sums:
                continue
            before = old.scrapes.get(source)
            if before is None or name not in before.sums:
                continue  # not scraped then (a peer down): no increase known, as Prometheus
            total += _delta(scrape.sums[name], before.sums[name])
        return total / elapsed

    def _latency(self) -> dict[str, Any]:
        old, new = self._polls[0], self._polls[-1]
        result: dict[str, Any] = {"window_s": round(new.t_s - old.t_s, 1)}
        for key, name in (("ttft_s", TTFT), ("itl_s", ITL)):
            buckets = _bucket_deltas(name, new.scrapes, old.scrapes)
            since_start = old is new or buckets.get(math.inf, 0.0) == 0
            if since_start:  # nothing in the window: what the processes saw since they started
                buckets = _bucket_deltas(name, new.scrapes, None)
            result[key] = {
                "p50": histogram_quantile(0.5, buckets),
                "p99": histogram_quantile(0.99, buckets),
                "count": int(buckets.get(math.inf, 0.0)),
                "since_start": since_start,
            }
        return result


def _bucket_deltas(
    name: str, new: Mapping[str, Scrape], old: Mapping[str, Scrape] | None
) -> dict[float, float]:
    """Bucket counts observed since `old` (None: since each process started), summed."""
    summed: dict[float, float] = {}
    for source, scrape in new.items():
        per_le = scrape.buckets.get(name)
        if not per_le:
            continue
        before = None if old is None else old.get(source)
        if old is not None and before is None:
            continue  # not scraped then: what it observed inside the window is unknown
        before_le = before.buckets.get(name, {}) if before else {}
        # a restarted process: its counts since the restart, all buckets alike
        restarted = any(count < before_le.get(le, 0.0) for le, count in per_le.items())
        for le, count in per_le.items():
            base = None if restarted else before_le.get(le)
            summed[le] = summed.get(le, 0.0) + _delta(count, base)
    return summed


def _sum(scrapes: Iterable[Scrape], name: str) -> float | None:
    values = [s.sums[name] for s in scrapes if name in s.sums]
    return sum(values) if values else None


def _merged_lag(scrapes: Iterable[Scrape]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for scrape in scrapes:
        for topic, lag in scrape.lag_by_topic.items():
            merged[topic] = merged.get(topic, 0.0) + lag
    return merged


def queue_depth(scrapes: Sequence[Scrape]) -> dict[str, float | None]:
    """Records not yet consumed per lane (its request topics' lag, over every pool and
    group); None for a lane whose topics no consumer reports."""
    depth: dict[str, float | None] = {lane.value: None for lane in Lane}
    for topic, lag in _merged_lag(scrapes).items():
        parsed = parse_request_topic(topic)
        if parsed is not None:
            depth[parsed[1].value] = (depth[parsed[1].value] or 0.0) + lag
    return depth


@dataclass(frozen=True, slots=True)
class SourceStatus:
    name: str
    ok: bool
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "error": self.error}


async def scrape_all(
    peers: Sequence[str],
    *,
    registry: CollectorRegistry = REGISTRY,
    timeout_s: float = 1.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[dict[str, Scrape], list[SourceStatus]]:
    """This process's registry and every peer's `/metrics`; a failing peer is reported,
    never raised."""
    scrapes: dict[str, Scrape] = {}
    try:
        scrapes[SELF] = parse_scrape(generate_latest(registry).decode())
        statuses = [SourceStatus(SELF, True)]
    except Exception as exc:  # a collector that fails must not fail the page
        logger.warning("dashboard: this process's metrics failed: %r", exc)
        statuses = [SourceStatus(SELF, False, f"{type(exc).__name__}: {exc}")]
    if not peers:
        return scrapes, statuses
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
        results = await asyncio.gather(*(_scrape_peer(client, url) for url in peers))
    for url, result in zip(peers, results, strict=True):
        if isinstance(result, Scrape):
            scrapes[url] = result
            statuses.append(SourceStatus(url, True))
        else:
            statuses.append(SourceStatus(url, False, result))
    return scrapes, statuses


async def _scrape_peer(client: httpx.AsyncClient, url: str) -> Scrape | str:
    """The peer's scrape, or why there is none."""
    try:
        response = await client.get(url)
        response.raise_for_status()
        return parse_scrape(response.text)
    except httpx.HTTPStatusError as exc:
        return f"HTTP {exc.response.status_code}"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except Exception as exc:  # not Prometheus text, or anything else: the peer is skipped
        return f"unreadable metrics: {type(exc).__name__}: {exc}"
