"""`sluice bench observability`: what tracing and metrics cost, on vs off in one run.

Two `sluice serve` processes on tiny-llama (embedded mode, in-memory bus), each with a
scratch data dir of its own, started side by side and loaded one at a time:

- OFF: `SLUICE_METRICS_ENABLED=false` and no `OTEL_*` variable (no span exporter, so no
  tracing consumer thread either).
- ON: metrics on, `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP receiver run
  here (a `http.server` thread answering 200 to `POST /v1/traces` and counting the spans
  of each `ExportTraceServiceRequest`), and a thread scraping ON's `/metrics` every
  second while ON is loaded, as Prometheus would.

The same seeded workload on both, in rounds alternating OFF, ON, OFF, ON, ... (each
round's prompts its own, the same for both arms), so a machine that slows down for a
while slows both: streaming chat completions over HTTP (httpx) with
`stream_options.include_usage`, a fixed number of prompt words, a fixed output length
(`ignore_eos`, greedy), first at a moderate Poisson rate the engine keeps up with (TTFT:
request sent to the first content chunk), then a saturating closed loop (output tokens/s
over the phase's wall time). Reported: TTFT p50/p99 per arm, added TTFT p50 (ON - OFF),
throughput ON/OFF, each arm's CPU per request (the serve process and the engine process,
from /proc, over its rounds and an equal pause after each), the spans received (with the
spans per request, by name) and the scrapes done; the checks: added TTFT p50 <= 1 ms,
throughput >= 0.97.

`python -m benchmarks.observability [--quick] [--json]`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from benchmarks.http_servers import Launch, Server, servers
from benchmarks.stats import mean_ci95, percentile, ratio
from sluice.tansu import free_port

TARGETS = {"added_ttft_p50_ms_max": 1.0, "throughput_on_vs_off_min": 0.97}
API_KEY = "sk-bench-observability"
MODEL = "tiny-llama"
ENDPOINT = "/v1/chat/completions"
ARMS = ("off", "on")
SPANS_SETTLE_S = 5.5  # the SDK's BatchSpanProcessor exports at least every 5 s
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_WORD_TEXT = (
    "river stone lantern harbor meadow copper violin thunder orchard glacier pepper canyon "
    "quartz willow saddle beacon marble falcon tundra ember velvet compass prairie cobalt "
    "ripple summit bramble anchor cinder lagoon walnut mosaic tempest juniper granite "
    "harvest nebula pebble citadel"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class Plan:
    rounds: int  # per arm
    rate: float  # requests/s of the Poisson phase
    poisson_s: float  # its arrivals' span
    prompt_words: int
    max_tokens: int  # of a Poisson request
    saturating_requests: int
    saturating_tokens: int
    concurrency: int  # streams of the closed loop


FULL = Plan(
    rounds=6,
    rate=6.0,
    poisson_s=20.0,
    prompt_words=48,
    max_tokens=32,
    saturating_requests=256,
    saturating_tokens=64,
    concurrency=48,
)
QUICK = Plan(
    rounds=4,
    rate=6.0,
    poisson_s=10.0,
    prompt_words=48,
    max_tokens=32,
    saturating_requests=192,
    saturating_tokens=64,
    concurrency=48,
)


# -- the OTLP/HTTP receiver -------------------------------------------------------------
class OtlpReceiver:
    """`POST /v1/traces` answered 200; counts spans (by name) and export requests."""

    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self.failed = 0
        self.names: Counter[str] = Counter()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # the exporter keeps its connection

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.split("?")[0] != "/v1/traces":
                    self._answer(404, b"")
                    return
                try:
                    receiver.receive(body, self.headers.get("Content-Encoding", ""))
                except Exception:
                    with receiver._lock:
                        receiver.failed += 1
                    self._answer(400, b"")
                    return
                self._answer(200, _EMPTY_RESPONSE)

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="bench-otlp", daemon=True
        )

    def receive(self, body: bytes, encoding: str) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        if encoding.strip().lower() == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        names: Counter[str] = Counter()
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                names.update(span.name for span in scope.spans)
        with self._lock:
            self.exports += 1
            self.spans += sum(names.values())
            self.names.update(names)

    def snapshot(self) -> tuple[int, Counter[str]]:
        with self._lock:
            return self.spans, Counter(self.names)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _empty_response() -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    return bytes(ExportTraceServiceResponse().SerializeToString())


_EMPTY_RESPONSE = _empty_response()


# -- the scraper ------------------------------------------------------------------------
class Scraper:
    """GET `url` every `interval_s` while `active` is set (ON's rounds), as Prometheus."""

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.active = threading.Event()
        self.done = 0
        self.failed = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set():
                if self.active.is_set():
                    try:
                        response = client.get(self.url)
                        response.raise_for_status()
                        self.done += 1
                        self.bytes = len(response.content)
                    except httpx.HTTPError:
                        self.failed += 1
                self._stop.wait(self.interval_s)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)


# -- the servers ------------------------------------------------------------------------
def arm_env(arm: str, otlp_port: int) -> dict[str, str]:
    """The process environment of an arm: no inherited OTEL_* or metrics switch."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OTEL_") and k != "SLUICE_METRICS_ENABLED"
    }
    env["SLUICE_MODEL"] = MODEL  # not the default model: this measures the telemetry's cost
    if arm == "off":
        env["SLUICE_METRICS_ENABLED"] = "false"
    else:
        env["SLUICE_METRICS_ENABLED"] = "true"
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{otlp_port}"
    return env


def launches(workdir: Path, otlp_port: int) -> dict[str, Launch]:
    """Both arms' `sluice serve`, each with a scratch data dir of its own."""
    out = {}
    for arm in ARMS:
        port = free_port()
        cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(port), "--data-dir",
               str(workdir / f"data-{arm}"), "--api-key", API_KEY]  # fmt: skip
        out[arm] = Launch(cmd, arm_env(arm, otlp_port), port)
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process `pid` and of its descendants (the engine
    process), from /proc; (0, 0) where there is no /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
                times[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    own = times.get(pid, 0.0)
    return own, sum(times.get(p, 0.0) for p in tree) - own


# -- the workload -----------------------------------------------------------------------
def bodies(n: int, words: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """n streaming chat requests of `words` seeded words, exactly `max_tokens` long."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{seed}.{i} {text}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return out


def arrivals(n_max: int, rate: float, span_s: float, seed: int) -> list[float]:
    """Poisson arrival offsets (seconds) within `span_s`."""
    rng, t, out = random.Random(seed), 0.0, []
    while len(out) < n_max:
        t += rng.expovariate(rate)
        if t > span_s:
            break
        out.append(t)
    return out


@dataclass(slots=True)
class Result:
    ttft_ms: float | None = None
    tokens: int = 0
    ok: bool = False


async def stream_one(
    client: httpx.AsyncClient, body: dict[str, Any], endpoint: str = ENDPOINT
) -> Result:
    """One streaming chat or text completion: TTFT at its first chunk with text, tokens
    from usage. `ok`: every token came (an output of tokens that decode to no text has no
    content chunk, so no TTFT; the same requests on both arms)."""
    result = Result()
    started = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if '"usage":{' in data:
                    result.tokens = json.loads(data)["usage"]["completion_tokens"]
                elif result.ttft_ms is None and data != "[DONE]":
                    choices = json.loads(data).get("choices")
                    if choices and (
                        choices[0].get("delta", {}).get("content") or choices[0].get("text")
                    ):
                        result.ttft_ms = (time.perf_counter() - started) * 1e3
    except httpx.HTTPError:
        return result
    result.ok = result.tokens == body["max_tokens"]
    return result


@dataclass(slots=True)
class ArmFigures:
    ttfts_ms: list[float] = field(default_factory=list)
    poisson_requests: int = 0
    poisson_failed: int = 0
    poisson_no_text: int = 0
    poisson_wall_s: float = 0.0
    saturating_tokens: int = 0
    saturating_failed: int = 0
    saturating_wall_s: float = 0.0
    round_ttft_p50_ms: list[float] = field(default_factory=list)
    round_tok_s: list[float] = field(default_factory=list)
    requests: int = 0  # every request of both phases
    serve_cpu_s: float = 0.0  # the serve process over its rounds (to the settle's end)
    engine_cpu_s: float = 0.0  # its descendants: the engine process

    def summary(self) -> dict[str, Any]:
        return {
            "poisson_requests": self.poisson_requests,
            "poisson_failed": self.poisson_failed,
            "poisson_no_text": self.poisson_no_text,
            "ttft_samples": len(self.ttfts_ms),
            "poisson_req_per_s": round(self.poisson_requests / self.poisson_wall_s, 2)
            if self.poisson_wall_s
            else 0.0,
            "ttft_p50_ms": round(percentile(self.ttfts_ms, 50), 2),
            "ttft_p90_ms": round(percentile(self.ttfts_ms, 90), 2),
            "ttft_p99_ms": round(percentile(self.ttfts_ms, 99), 2),
            "ttft_p50_ms_rounds": self.round_ttft_p50_ms,
            "saturating_tokens": self.saturating_tokens,
            "saturating_failed": self.saturating_failed,
            "saturating_wall_s": round(self.saturating_wall_s, 2),
            "tokens_per_s": round(self.saturating_tokens / self.saturating_wall_s, 1)
            if self.saturating_wall_s
            else 0.0,
            "tokens_per_s_rounds": self.round_tok_s,
            "requests": self.requests,
            "serve_cpu_ms_per_request": round(self.serve_cpu_s * 1e3 / self.requests, 2)
            if self.requests
            else 0.0,
            "engine_cpu_ms_per_request": round(self.engine_cpu_s * 1e3 / self.requests, 2)
            if self.requests
            else 0.0,
        }


async def poisson_phase(
    client: httpx.AsyncClient, plan: Plan, seed: int, figures: ArmFigures
) -> None:
    offsets = arrivals(100_000, plan.rate, plan.poisson_s, seed)
    requests = bodies(len(offsets), plan.prompt_words, plan.max_tokens, seed)
    start = time.perf_counter()

    async def one(offset: float, body: dict[str, Any]) -> Result:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await stream_one(client, body)

    results = await asyncio.gather(*(one(o, b) for o, b in zip(offsets, requests, strict=True)))
    figures.poisson_wall_s += time.perf_counter() - start
    ttfts = [r.ttft_ms for r in results if r.ok and r.ttft_ms is not None]
    figures.ttfts_ms += ttfts
    figures.round_ttft_p50_ms.append(round(percentile(ttfts, 50), 2))
    figures.poisson_requests += sum(1 for r in results if r.ok)
    figures.poisson_failed += sum(1 for r in results if not r.ok)
    # an output whose every token decodes to no text has no content chunk: no TTFT
    figures.poisson_no_text += sum(1 for r in results if r.ok and r.ttft_ms is None)
    figures.requests += len(results)


async def saturating_phase(
    client: httpx.AsyncClient, plan: Plan, seed: int, figures: ArmFigures
) -> None:
    """`plan.concurrency` streams, each sending its next request when one ends."""
    queue = list(
        reversed(bodies(plan.saturating_requests, plan.prompt_words, plan.saturating_tokens, seed))
    )
    results: list[Result] = []

    async def user() -> None:
        while queue:
            results.append(await stream_one(client, queue.pop()))

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(plan.concurrency)))
    wall_s = time.perf_counter() - start
    tokens = sum(r.tokens for r in results if r.ok)
    figures.saturating_wall_s += wall_s
    figures.saturating_tokens += tokens
    figures.saturating_failed += sum(1 for r in results if not r.ok)
    figures.round_tok_s.append(round(tokens / wall_s, 1))
    figures.requests += len(results)


def _client(server: Server, plan: Plan) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=server.base_url,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120.0,
        limits=httpx.Limits(max_connections=plan.concurrency + 64),
    )


def _successes(base_url: str) -> float:
    """`vllm:request_success_total` summed over labels, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


async def _run_async(workdir: Path, plan: Plan) -> dict[str, Any]:
    figures = {arm: ArmFigures() for arm in ARMS}
    with (
        OtlpReceiver() as receiver,
        servers(launches(workdir, receiver.port), workdir) as served,
        Scraper(f"{served['on'].base_url}/metrics") as scraper,
    ):
        clients = {arm: _client(served[arm], plan) for arm in ARMS}
        try:
            for arm in ARMS:  # warm-up: both paths, both phases, not counted
                warm = ArmFigures()
                await poisson_phase(clients[arm], replace(plan, poisson_s=3.0), 999, warm)
                await saturating_phase(clients[arm], plan, 999, warm)
            await asyncio.sleep(SPANS_SETTLE_S)
            spans_before, names_before = receiver.snapshot()
            for k in range(plan.rounds):
                for arm in ARMS:
                    if arm == "on":
                        scraper.active.set()
                    cpu_before = cpu_seconds(served[arm].proc.pid)
                    await poisson_phase(clients[arm], plan, k, figures[arm])
                    await saturating_phase(clients[arm], plan, 1000 + k, figures[arm])
                    scraper.active.clear()
                    # ON's last spans leave before OFF runs; the same pause after OFF,
                    # so each arm's CPU is counted over the same idle tail
                    await asyncio.sleep(SPANS_SETTLE_S)
                    cpu_after = cpu_seconds(served[arm].proc.pid)
                    figures[arm].serve_cpu_s += cpu_after[0] - cpu_before[0]
                    figures[arm].engine_cpu_s += cpu_after[1] - cpu_before[1]
            await asyncio.sleep(SPANS_SETTLE_S)
            spans_after, names_after = receiver.snapshot()
            successes = {arm: _successes(served[arm].base_url) for arm in ARMS}
        except BaseException:
            for server in served.values():
                sys.stderr.write(f"sluice serve ({server.arm}), last lines:\n")
                sys.stderr.write(f"{server.log_tail()}\n")
            raise
        finally:
            for client in clients.values():
                await client.aclose()
    on = figures["on"]
    requests_on = on.requests
    spans = spans_after - spans_before
    names = names_after - names_before
    off_s, on_s = figures["off"].summary(), on.summary()
    # each ON round against the OFF round just before it: the spread shows the noise
    round_ratios = [
        ratio(b, a)
        for a, b in zip(off_s["tokens_per_s_rounds"], on_s["tokens_per_s_rounds"], strict=True)
    ]
    return {
        "arms": {"off": off_s, "on": on_s},
        "added_ttft_p50_ms": round(on_s["ttft_p50_ms"] - off_s["ttft_p50_ms"], 2),
        "added_ttft_p99_ms": round(on_s["ttft_p99_ms"] - off_s["ttft_p99_ms"], 2),
        "throughput_ratio": ratio(on_s["tokens_per_s"], off_s["tokens_per_s"]),
        "throughput_ratio_rounds": round_ratios,
        # the per-round ratios' mean and its 95 % interval: how far one run resolves it
        "throughput_ratio_rounds_mean_ci95": [round(x, 3) for x in mean_ci95(round_ratios)],
        "added_serve_cpu_ms_per_request": round(
            on_s["serve_cpu_ms_per_request"] - off_s["serve_cpu_ms_per_request"], 2
        ),
        "tracing": {
            "spans": spans,
            "requests": requests_on,
            "spans_per_request": round(spans / requests_on, 2) if requests_on else 0.0,
            "per_request_by_name": {
                name: round(count / requests_on, 2) for name, count in sorted(names.items())
            },
            "exports": receiver.exports,
            "receiver_failures": receiver.failed,
        },
        "metrics": {
            "scrapes": scraper.done,
            "scrape_failures": scraper.failed,
            "scrape_bytes": scraper.bytes,
            "request_success_total": successes,
        },
    }


def _checks(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tracing, metrics = result["tracing"], result["metrics"]
    out = {
        "added_ttft_p50_ms_max": {
            "value": result["added_ttft_p50_ms"],
            "target": TARGETS["added_ttft_p50_ms_max"],
            "ok": result["added_ttft_p50_ms"] <= TARGETS["added_ttft_p50_ms_max"],
        },
        "throughput_on_vs_off_min": {
            "value": result["throughput_ratio"],
            "target": TARGETS["throughput_on_vs_off_min"],
            "ok": result["throughput_ratio"] >= TARGETS["throughput_on_vs_off_min"],
        },
        "tracing_on": {
            "value": tracing["spans"],
            "target": "spans received > 0, >= 1 per ON request",
            "ok": tracing["spans"] > 0 and tracing["spans"] >= tracing["requests"],
        },
        "metrics_on_and_off": {
            "value": metrics["request_success_total"],
            "target": "ON counted its requests and was scraped; OFF counted none",
            "ok": metrics["request_success_total"]["on"] > 0
            and metrics["request_success_total"]["off"] == 0
            and metrics["scrapes"] > 0,
        },
    }
    failed = sum(a["poisson_failed"] + a["saturating_failed"] for a in result["arms"].values())
    out["no_failed_requests"] = {
        "value": failed,
        "target": "every request streamed its tokens",
        "ok": failed == 0,
    }
    return out


def run(quick: bool = False) -> dict[str, Any]:
    """The whole benchmark, in a scratch directory (the servers' data dirs and logs)."""
    plan = QUICK if quick else FULL
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-observability-") as tmp:
        result = asyncio.run(_run_async(Path(tmp), plan))
    result.update(
        model=MODEL,
        quick=quick,
        plan=asdict(plan),
        checks=_checks(result),
        # other work on the machine shares its cores: the load before and after the run
        load_avg_1m=[round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        elapsed_s=round(time.perf_counter() - started, 1),
    )
    return result


def render(result: dict[str, Any]) -> str:
    plan, off, on = result["plan"], result["arms"]["off"], result["arms"]["on"]
    tracing, metrics = result["tracing"], result["metrics"]
    lines = [
        f"model {result['model']}, {plan['rounds']} rounds per arm (OFF, ON alternating); "
        f"Poisson {plan['rate']} req/s for {plan['poisson_s']} s, {plan['prompt_words']} "
        f"words -> {plan['max_tokens']} tokens; saturating {plan['saturating_requests']} x "
        f"{plan['saturating_tokens']} tokens, {plan['concurrency']} streams; load average "
        f"before/after {result['load_avg_1m']}; {result['elapsed_s']} s",
        f"{'arm':<4} {'req':>5} {'TTFTs':>5} {'req/s':>6} {'TTFT p50':>9} {'p90':>7}"
        f" {'p99':>7} {'tok/s':>8}  per-round TTFT p50 / tok/s",
    ]
    for name, arm in (("OFF", off), ("ON", on)):
        lines.append(
            f"{name:<4} {arm['poisson_requests']:>5} {arm['ttft_samples']:>5}"
            f" {arm['poisson_req_per_s']:>6}"
            f" {arm['ttft_p50_ms']:>9.2f} {arm['ttft_p90_ms']:>7.2f} {arm['ttft_p99_ms']:>7.2f}"
            f" {arm['tokens_per_s']:>8.1f}  {arm['ttft_p50_ms_rounds']} / "
            f"{arm['tokens_per_s_rounds']}"
        )
    lines += [
        f"added TTFT p50 (ON - OFF): {result['added_ttft_p50_ms']} ms; p99: "
        f"{result['added_ttft_p99_ms']} ms; throughput ON / OFF: {result['throughput_ratio']}x"
        f" (per round: {result['throughput_ratio_rounds']}; their mean and 95 % interval: "
        f"{result['throughput_ratio_rounds_mean_ci95'][0]} ± "
        f"{result['throughput_ratio_rounds_mean_ci95'][1]})",
        f"CPU per request, serve process / engine process: OFF {off['serve_cpu_ms_per_request']}"
        f" / {off['engine_cpu_ms_per_request']} ms, ON {on['serve_cpu_ms_per_request']} / "
        f"{on['engine_cpu_ms_per_request']} ms ({off['requests']} / {on['requests']} requests);"
        f" added in serve: {result['added_serve_cpu_ms_per_request']} ms",
        f"spans received: {tracing['spans']} for {tracing['requests']} ON requests "
        f"({tracing['spans_per_request']} per request, {tracing['exports']} exports): "
        f"{tracing['per_request_by_name']}",
        f"scrapes of ON's /metrics: {metrics['scrapes']} ({metrics['scrape_failures']} failed,"
        f" {metrics['scrape_bytes']} bytes each); vllm:request_success_total at the end: "
        f"{metrics['request_success_total']}",
    ]
    for name, check in result["checks"].items():
        mark = "ok  " if check["ok"] else "MISS"
        lines.append(f"[{mark}] {name}: {check['value']} (target {check['target']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.observability", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 rounds per arm (about 4 min)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
