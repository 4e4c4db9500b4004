"""Every Prometheus metric of Sluice, defined once, and the helpers that feed them.

vLLM's names (`vllm:*`, label `model_name`) for what the engine worker sees, so that
dashboards made for vLLM work on Sluice; `sluice_*` for the pipeline around it (bus lag,
admission, publish latency, dead letters, billing, batches). All live in
prometheus_client's default registry: `GET /metrics` on the gateway
(`api.routes.metrics`) and `start_metrics_server` in every worker process expose them.

No tenant label on any histogram (cardinality); per-tenant numbers live in the ledger.
Telemetry never breaks the request: every helper here swallows its own failures.

`set_enabled(False)` (SLUICE_METRICS_ENABLED=false, applied by the composition root at
process start) turns every helper that counts or observes into an immediate return: one
check of a module global. `/metrics` still answers with whatever the registry holds.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.bus.base import TopicPartition
from sluice.bus.messages import UsageRecord

logger = logging.getLogger(__name__)

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below its smallest: a
# small model on a CPU decodes a token in a few milliseconds
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PUBLISH_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

MODEL = ("model_name",)

# -- the engine (vLLM's names) ---------------------------------------------------------
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prefill tokens processed.", MODEL)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Generation tokens processed.", MODEL)
REQUEST_SUCCESS = Counter(
    "vllm:request_success",
    "Finished attempts, by finish reason (stop, length, abort, deadline, error).",
    (*MODEL, "finished_reason"),
)
PREFIX_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", MODEL
)
PREFIX_CACHE_HITS = Counter(
    "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", MODEL
)
TIME_TO_FIRST_TOKEN = Histogram(
    "vllm:time_to_first_token_seconds",
    "Gateway publish to the attempt's first token.",
    MODEL,
    buckets=TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between output tokens of a request.",
    MODEL,
    buckets=ITL_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Gateway publish to the attempt's last token.",
    MODEL,
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_QUEUE_TIME = Histogram(
    "vllm:request_queue_time_seconds",
    "Gateway publish to engine admission: the wait on the bus and in the worker.",
    MODEL,
    buckets=REQUEST_LATENCY_BUCKETS,
)


# -- the pipeline ---------------------------------------------------------------------
CONSUMER_LAG = Gauge(
    "sluice_consumer_lag_records",
    "Records not yet consumed by a group, on the partitions this process holds.",
    ("group", "topic"),
)
ADMISSION_DECISIONS = Counter(
    "sluice_admission_decisions",
    "Gateway admission decisions per sub-request (rejected: the limit that said no).",
    ("decision", "reason"),
)
BUS_PUBLISH_SECONDS = Histogram(
    "sluice_bus_publish_seconds",
    "Publish call to the broker's acknowledgement.",
    ("topic",),
    buckets=PUBLISH_BUCKETS,
)
SLO_REFUSALS = Counter(
    "sluice_slo_refusals",
    "Sub-requests refused before publishing: their lane's predicted TTFT missed its target.",
    ("lane",),
)
# actual minus predicted: negative when the request was served sooner than predicted
TTFT_PREDICTION_ERROR = Histogram(
    "sluice_ttft_prediction_error_seconds",
    "Actual minus predicted time to first token of admitted requests (SLO admission).",
    ("lane",),
    buckets=(-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0),
)
DEAD_LETTERS = Counter(
    "sluice_dead_letters", "Records copied to a dead-letter topic, by source topic.", ("topic",)
)
BILLING_LAG = Gauge(
    "sluice_billing_lag_seconds",
    "Now minus the finish time of the newest usage record billed (NaN before the first).",
)
TOKENS_BILLED = Counter("sluice_tokens_billed", "Tokens written to the usage ledger.", ("lane",))
BATCH_LINES = Counter(
    "sluice_batch_lines", "Batch lines stored, by outcome (completed, failed).", ("outcome",)
)
BATCHES = Gauge("sluice_batches", "Batches that are not finished, per status.", ("status",))

ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

_enabled = True  # read by every helper below; set once at process start


def set_enabled(enabled: bool) -> None:
    """Metrics on (the default) or off: off, every observe/count helper returns at once."""
    global _enabled
    _enabled = bool(enabled)


def metrics_enabled() -> bool:
    return _enabled


# -- engine gauges, read at scrape time ------------------------------------------------
class EngineStatsLike(Protocol):
    """What of `engine.backends.base.EngineStats` the gauges read (tracing never
    imports the engine: the gateway imports this module)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_pending(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...


class _EngineStatsCollector(Collector):
    """The engine gauges, read from each watched backend's `stats()` when scraped: the
    engine's step path takes no lock and sets nothing for them."""

    def __init__(self) -> None:
        self._sources: dict[int, tuple[str, Callable[[], EngineStatsLike]]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def watch(self, model_name: str, stats: Callable[[], EngineStatsLike]) -> Callable[[], None]:
        with self._lock:
            key = self._next
            self._next += 1
            self._sources[key] = (model_name, stats)

        def unwatch() -> None:
            with self._lock:
                self._sources.pop(key, None)

        return unwatch

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "vllm:num_requests_running", "Requests in the engine's running batch.", labels=MODEL
            ),
            GaugeMetricFamily(
                "vllm:num_requests_waiting",
                "Requests submitted to the engine and waiting for it (preempted included).",
                labels=MODEL,
            ),
            GaugeMetricFamily(
                "vllm:kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0..1).",
                labels=MODEL,
            ),
        ]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources.values())
        totals: dict[str, list[float]] = {}  # several workers of one model in a process add up
        for model_name, read in sources:
            try:
                stats = read()
                row = totals.setdefault(model_name, [0.0, 0.0, 0.0, 0.0])
                row[0] += stats.num_running
                row[1] += stats.num_waiting + stats.num_pending
                row[2] += stats.kv_usage
                row[3] += 1
            except Exception:  # a dying engine must not fail the scrape
                logger.debug("engine stats unavailable for %s", model_name, exc_info=True)
        running, waiting, kv = self._families()
        for model_name, (num_running, num_waiting, kv_usage, n) in totals.items():
            running.add_metric([model_name], num_running)
            waiting.add_metric([model_name], num_waiting)
            kv.add_metric([model_name], kv_usage / n)  # each engine has its own cache
        yield from (running, waiting, kv)


_ENGINES = _EngineStatsCollector()
REGISTRY.register(_ENGINES)


def watch_engine(model_name: str, stats: Callable[[], EngineStatsLike]) -> Callable[[], None]:
    """Expose an engine's running/waiting/KV gauges; returns the call that stops it."""
    return _ENGINES.watch(model_name, stats)


# -- per finished attempt (the engine worker) ------------------------------------------
def observe_attempt(usage: UsageRecord) -> None:
    """Count one finished attempt: tokens, prefix cache, finish reason, and its latencies.

    From the attempt's usage record (`consumers.engine_outputs`), so the counters equal
    what the ledger bills. Latencies only for an attempt that ran (it was scheduled);
    they start at the gateway's publish (`Timings.queued_ms`), so a resumed attempt's
    count from the original request's publish.
    """
    if not _enabled:
        return
    try:
        model = usage.model
        PROMPT_TOKENS.labels(model).inc(usage.prompt_tokens)
        PREFIX_CACHE_QUERIES.labels(model).inc(usage.prompt_tokens)
        PREFIX_CACHE_HITS.labels(model).inc(usage.cached_tokens)
        REQUEST_SUCCESS.labels(model, usage.finish_reason).inc()
        timings = usage.timings
        if timings.scheduled_ms is None:
            return
        REQUEST_QUEUE_TIME.labels(model).observe(_seconds(timings.scheduled_ms, timings.queued_ms))
        E2E_REQUEST_LATENCY.labels(model).observe(_seconds(timings.finished_ms, timings.queued_ms))
        if timings.first_token_ms is not None:
            ttft_s = _seconds(timings.first_token_ms, timings.queued_ms)
            TIME_TO_FIRST_TOKEN.labels(model).observe(ttft_s)
    except Exception:
        logger.warning("request_id=%s metrics not recorded", usage.request_id, exc_info=True)


def _seconds(end_ms: int, start_ms: int) -> float:
    return max(0, end_ms - start_ms) / 1000


class StepTimer:
    """Generation tokens and inter-token latency of each engine step, per request.

    vLLM observes each inter-token interval. The worker has no per-token times, only
    each step's deltas as they reach it from the engine: a step's interval since the
    request's previous tokens is divided evenly over the tokens it brought, one
    observation each (one, but for a step that carries several). The first tokens of an
    attempt have no previous ones (that gap is the TTFT). Generation tokens count here,
    per step, so their rate is live; prompt tokens count per finished attempt. Used on
    the engine worker's loop thread only; `step` is its hot path: per request, one dict
    lookup and one observation.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # injectable so a test can set each gap
        self._last: dict[str, float] = {}  # request_id → when its latest tokens came
        self._children: dict[str, tuple[Any, Any]] = {}

    def step(self, tokens: Iterable[tuple[str, str, int, bool]]) -> None:
        """`tokens`: (request_id, model, new tokens, finished) of each request this step."""
        if not _enabled:
            return
        try:
            self._step(tokens)
        except Exception:
            logger.warning("step metrics not recorded", exc_info=True)

    def _step(self, tokens: Iterable[tuple[str, str, int, bool]]) -> None:
        now = self._clock()
        last = self._last
        # a step's requests mostly share their previous step: one observation of each
        # distinct gap, counted as many times as it occurs (`_observe_many`)
        generated: dict[str, int] = {}
        gaps: dict[tuple[str, float], int] = {}
        for request_id, model, n, finished in tokens:
            if n:
                generated[model] = generated.get(model, 0) + n
                previous = last.get(request_id)
                if previous is not None:
                    key = (model, (now - previous) / n)
                    gaps[key] = gaps.get(key, 0) + n
                last[request_id] = now
            if finished:
                last.pop(request_id, None)
        for model, n in generated.items():
            self._pair(model)[0].inc(n)
        for (model, gap_s), count in gaps.items():
            _observe_many(self._pair(model)[1], gap_s, count)
        if len(last) > 100_000:  # requests that ended without a terminal delta here
            self._last = {}

    def _pair(self, model: str) -> tuple[Any, Any]:
        pair = self._children.get(model)
        if pair is None:
            pair = self._children[model] = (
                GENERATION_TOKENS.labels(model),
                INTER_TOKEN_LATENCY.labels(model),
            )
        return pair

    def forget(self, request_id: str) -> None:
        """The request left without a terminal step here (its engine died, it moved)."""
        self._last.pop(request_id, None)


def _observe_many(histogram: Any, amount: float, count: int) -> None:
    """`count` observations of `amount`: one bucket and sum update instead of `count`
    (prometheus_client has no weighted observe; its buckets are read here as its own
    `observe` does, with a plain loop where a version lacks them)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if count == 1 or bounds is None or buckets is None or total is None:
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    buckets[bisect.bisect_left(bounds, amount)].inc(count)


# -- the pipeline ---------------------------------------------------------------------
def time_publish(future: Future[Any], topic: str) -> Future[Any]:
    """Observe `sluice_bus_publish_seconds` when the bus confirms `future`; returns it."""
    if not _enabled:
        return future
    started = time.perf_counter()

    def done(f: Future[Any]) -> None:
        try:
            if not f.cancelled() and f.exception() is None:
                BUS_PUBLISH_SECONDS.labels(topic).observe(time.perf_counter() - started)
        except Exception:
            logger.debug("publish latency not recorded", exc_info=True)

    try:
        future.add_done_callback(done)
    except Exception:
        logger.debug("publish latency not recorded", exc_info=True)
    return future


class LagReporter:
    """`sluice_consumer_lag_records` of one consumer group, refreshed at most every
    `interval_s`: `due()` says when, `report()` sets it (per topic, summed over the
    partitions this process holds; 0 for a topic it holds none of)."""

    def __init__(self, group: str, topics: Iterable[str], interval_s: float = 2.0) -> None:
        self.group = group
        self.topics = list(topics)
        self.interval_s = interval_s
        self._next = 0.0

    def due(self) -> bool:
        if not _enabled:  # nobody reads the lag then
            return False
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def report(self, lag: Mapping[TopicPartition, int]) -> None:
        if not _enabled:
            return
        try:
            per_topic = dict.fromkeys(self.topics, 0)
            for tp, records in lag.items():
                per_topic[tp.topic] = per_topic.get(tp.topic, 0) + max(0, records)
            for topic, records in per_topic.items():
                CONSUMER_LAG.labels(self.group, topic).set(records)
        except Exception:
            logger.debug("group=%s lag not recorded", self.group, exc_info=True)

    def refresh(self, read_lag: Callable[[], Mapping[TopicPartition, int]]) -> None:
        """`report(read_lag())` when due; a consumer that cannot say is skipped."""
        if not self.due():
            return
        try:
            lag = read_lag()
        except Exception:
            logger.debug("group=%s lag unavailable", self.group, exc_info=True)
            return
        self.report(lag)


def count_admission(decision: str, reason: str, n: int = 1) -> None:
    """`sluice_admission_decisions_total{decision, reason}` += n."""
    if not _enabled:
        return
    try:
        ADMISSION_DECISIONS.labels(decision, reason).inc(n)
    except Exception:
        logger.debug("admission decision not recorded", exc_info=True)


def count_slo_refusal(lane: str, n: int = 1) -> None:
    """`sluice_slo_refusals_total{lane}` += n."""
    if not _enabled:
        return
    try:
        SLO_REFUSALS.labels(lane).inc(n)
    except Exception:
        logger.debug("slo refusal not recorded", exc_info=True)


def observe_ttft_prediction_error(lane: str, error_s: float) -> None:
    """Actual minus predicted time to first token of an admitted request (`api.slo`)."""
    if not _enabled:
        return
    try:
        TTFT_PREDICTION_ERROR.labels(lane).observe(error_s)
    except Exception:
        logger.debug("ttft prediction error not recorded", exc_info=True)


def count_dead_letter(topic: str) -> None:
    if not _enabled:
        return
    try:
        DEAD_LETTERS.labels(topic).inc()
    except Exception:
        logger.debug("dead letter not recorded", exc_info=True)


class BillingLag:
    """`sluice_billing_lag_seconds`: now minus the finish of the newest record billed,
    computed at scrape time so an idle consumer's lag keeps growing."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall-clock seconds; injectable so a test can fix "now"
        self._newest_ms: int | None = None
        BILLING_LAG.set_function(self.seconds)

    def seconds(self) -> float:
        newest = self._newest_ms
        return math.nan if newest is None else max(0.0, self._clock() - newest / 1000)

    def billed(self, usage: UsageRecord, new: bool) -> None:
        if not _enabled:
            return
        try:
            finished_ms = usage.timings.finished_ms
            if self._newest_ms is None or finished_ms > self._newest_ms:
                self._newest_ms = finished_ms
            if new:
                TOKENS_BILLED.labels(usage.lane.value).inc(
                    usage.prompt_tokens + usage.completion_tokens
                )
        except Exception:
            logger.debug("billing metrics not recorded", exc_info=True)


def count_batch_lines(completed: int, failed: int) -> None:
    if not _enabled:
        return
    try:
        if completed:
            BATCH_LINES.labels("completed").inc(completed)
        if failed:
            BATCH_LINES.labels("failed").inc(failed)
    except Exception:
        logger.debug("batch lines not recorded", exc_info=True)


def set_batch_counts(counts: Mapping[str, int]) -> None:
    """`sluice_batches{status}` for the unfinished statuses (0 for those with none)."""
    if not _enabled:
        return
    try:
        for status in ACTIVE_BATCH_STATUSES:
            BATCHES.labels(status).set(counts.get(status, 0))
    except Exception:
        logger.debug("batch counts not recorded", exc_info=True)


def _up() -> bool:
    return True


# what a worker's /healthz and /readyz answer (`set_probes`); until then: the process is up
_probes: dict[str, Callable[[], bool]] = {"/healthz": _up, "/readyz": _up}


def set_probes(*, healthy: Callable[[], bool], ready: Callable[[], bool]) -> None:
    """Answer the metrics server's `/healthz` and `/readyz` from these (200 or 503), so an
    orchestrator can wait for an engine worker's model and restart one that cannot serve."""
    _probes.update({"/healthz": healthy, "/readyz": ready})


def start_metrics_server(port: int | None, host: str = "127.0.0.1") -> bool:
    """Serve this process's metrics on `http://host:port/metrics` (a daemon thread), and
    `/healthz`, `/readyz` (`set_probes`); nothing when `port` is None. False (logged)
    when the port cannot be bound: a worker without metrics still works.

    Always the text format, as `GET /metrics` on the gateway: prometheus_client's own
    server answers a scraper that asks for OpenMetrics (Prometheus does) with the
    colons of `vllm:*` sample names turned into underscores (prometheus_client 0.26).
    """
    if port is None:
        return False
    try:
        server = ThreadingHTTPServer((host, port), _MetricsHandler)
    except OSError as exc:
        logger.warning("metrics server not started on %s:%s: %s", host, port, exc)
        return False
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="sluice-metrics", daemon=True)
    thread.start()
    logger.info("metrics on http://%s:%s/metrics", host, port)
    return True


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        probe = _probes.get(path)
        if probe is not None:
            self._probe(probe)
            return
        if path not in ("/metrics", "/"):
            self.send_error(404)
            return
        try:
            body = generate_latest(REGISTRY)
        except Exception:
            logger.exception("metrics could not be rendered")
            self.send_error(500)
            return
        self._send(200, CONTENT_TYPE_LATEST, body)

    def _probe(self, probe: Callable[[], bool]) -> None:
        try:
            ok = probe()
        except Exception:  # a probe that cannot tell says not ok
            logger.exception("probe %s failed", self.path)
            ok = False
        body = b'{"status":"ok"}' if ok else b'{"status":"unavailable"}'
        self._send(200 if ok else 503, "application/json", body)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return None  # a scrape every few seconds is not worth a log line
