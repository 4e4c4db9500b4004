"""`sluice bench scale`: 1, 2 and 4 engine workers behind one gateway, on Kafka.

Per size N: a fresh consumer group of N `sluice worker engine` processes (the `sim`
backend by default: a modelled GPU that sleeps its step times, so the workers need
little CPU), one gateway (`GatewayService`, in this process, driven without HTTP by
`serving_runs.PipelineClient`) and a closed loop of `2 x max_num_seqs x N` streams over
many tenants, which keeps every worker's batch full, in rounds of a fresh gateway each
(`run_rounds`), every stage on a fresh Tansu (`_start_broker`): output tokens/s,
requests/s, TTFT p50/p99, the ratio to N=1, and the CPU each party used.

Each row also counts the tokens that requests which ended with "length" never delivered
(`tokens_short`: a delta lost on the way; the gateway logs "gap in deltas").

Then the gateway's capacity: 4 workers with room for every stream (max_num_seqs and the
worker's in-engine cap raised above the level), each stream paced at a reading rate
(`PROBE_STREAM_TOKENS_PER_S`: the sim's steps take at least 1/rate s), the closed loop
raised level by level. Unpaced, the default preset gives each of a few streams ~160
tokens/s, so the probe would measure how many tokens/s the host carries, not how many
streams one gateway holds.
Added latency per request is its TTFT minus the engine's own part, read from the
worker's telemetry (engine submit → first token: the sim's modelled prefill and the wait
for its step in progress): what the gateway, the bus and the worker's admission add.
The answer is the last level whose p99 added latency stays under 50 ms.

`python -m benchmarks.scale [--quick] [--kafka BOOTSTRAP] [--json]`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import serving_runs as runs
from benchmarks.faults_infra import cpu_ticks
from benchmarks.serving_procs import kafka_config
from benchmarks.stats import percentile, ratio
from sluice.bus.codec import decode_as
from sluice.bus.kafka import KafkaEventBus
from sluice.bus.messages import TelemetryRecord, Timings
from sluice.bus.topics import TELEMETRY_TOPIC, Lane, TopicLayout, pool_id, request_topic
from sluice.settings import BusSettings, CommonSettings, load_settings
from sluice.tansu import TansuBroker

SIZES = (1, 2, 4)
PARTITIONS = 8  # per lane topic: 1, 2 and 4 workers each hold the same share
POOL = pool_id("tiny-llama")  # the workers' model (SLUICE_MODEL below): its lanes
TENANTS = 64  # a tenant's requests share a partition: many tenants spread the load
PROMPT_LEN = (128, 512)
OUTPUT_LEN = (64, 192)
PROBE_LEVELS = (10, 25, 100, 250, 500, 1000, 2000, 4000)
PROBE_STREAM_TOKENS_PER_S = 20.0  # a stream's pace in the probe: faster than people read
TARGETS = {"scale_ratio_4_min": 3.4, "probe_added_ttft_p99_ms_max": 50.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")
TAP_MAX_WAIT_MS = 200


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """How long each measurement runs (seconds), and the probe's levels."""

    ramp_s: float
    window_s: float
    rounds: int
    levels: tuple[int, ...]


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(ramp_s=4.0, window_s=12.0, rounds=1, levels=PROBE_LEVELS[2:7])
    return Plan(ramp_s=4.0, window_s=10.0, rounds=3, levels=PROBE_LEVELS)


# -- processes --------------------------------------------------------------------------
def _children(pids: set[int]) -> set[int]:
    """`pids` and every process below them (the engine process of a torch worker)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, grew = set(pids), True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


class Workers:
    """N `sluice worker engine` processes in one consumer group, logs in `log_dir`."""

    def __init__(
        self, n: int, bootstrap: str, backend: str, env: dict[str, str], log_dir: Path
    ) -> None:
        self.group_id = f"bench-scale-{n}-{uuid.uuid4().hex[:6]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(n):
            worker_env = {
                **os.environ,
                "SLUICE_KAFKA_BOOTSTRAP": bootstrap,
                "SLUICE_BACKEND": backend,
                "SLUICE_ENGINE_GROUP_ID": self.group_id,
                "SLUICE_WORKER_ID": f"{self.group_id}-w{i}",
                "SLUICE_REQUEST_PARTITIONS": str(PARTITIONS),
                **env,
            }
            log = (log_dir / f"{self.group_id}-w{i}.log").open("wb")
            cmd = [sys.executable, "-m", "sluice.cli", "worker", "engine"]
            self.procs.append(
                subprocess.Popen(cmd, env=worker_env, stdout=log, stderr=subprocess.STDOUT)
            )
            log.close()

    def cpu_s(self) -> float:
        pids = _children({p.pid for p in self.procs})
        return sum(cpu_ticks(pid) for pid in pids) / CLK_TCK

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)


class TelemetryTap:
    """Every telemetry record published from now on, kept raw by a thread (cheap while a
    window is measured) and decoded when asked."""

    def __init__(self, bootstrap: str) -> None:
        self._bus = KafkaEventBus(kafka_config(bootstrap, "sluice-bench-scale-tap"))
        # read after each window, never on a request's path: a long fetch wait spares the
        # broker's CPU (an idle 5 ms fetch loop costs Tansu a tenth of a core)
        self._consumer = self._bus.consumer(
            f"scale-tap-{uuid.uuid4().hex[:8]}",
            [TELEMETRY_TOPIC],
            offset_reset="latest",
            max_wait_ms=TAP_MAX_WAIT_MS,
        )
        self._raw: list[bytes] = []
        self._seen: dict[str, tuple[str, Timings]] = {}
        self._listening, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-scale-tap", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            records = self._consumer.poll(0.1, 1000)
            if self._consumer.assignment():
                self._listening.set()
            self._raw.extend(r.value for r in records)

    def wait_listening(self, timeout_s: float) -> None:
        if not self._listening.wait(timeout_s):
            raise RuntimeError("the telemetry consumer got no partition")
        time.sleep(1.0)  # its position ("latest") resolved before the first record

    def seen(self) -> dict[str, tuple[str, Timings]]:
        """request_id → (worker_id, timings) of each first attempt seen so far."""
        raw, self._raw = self._raw, []
        for value in raw:
            record = decode_as(TelemetryRecord, value)
            if record.attempt == 0:
                self._seen[record.request_id] = (record.worker_id, record.timings)
        return self._seen

    async def wait_for(self, request_ids: Sequence[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(r in self.seen() for r in request_ids):
            await asyncio.sleep(0.2)

    def close(self) -> None:
        self._done.set()
        self._thread.join(5.0)
        self._consumer.close()
        self._bus.close()


# -- load -------------------------------------------------------------------------------
Meters = dict[str, Callable[[], float]]  # CPU seconds used so far, by party


@dataclasses.dataclass(slots=True)
class Window:
    """The measured part of a closed-loop run: perf_counter bounds, CPU seconds each
    party used inside them (`gateway`: this process)."""

    start: float = 0.0
    end: float = 0.0
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    traces: list[runs.Trace] = dataclasses.field(default_factory=list)


async def closed_loop(
    client: runs.PipelineClient,
    streams: int,
    plan_: Plan,
    seed: int,
    meters: Meters | None = None,
) -> Window:
    """`streams` clients, each sending its next request as the last one ends, starts
    spread over the ramp; the window opens after it. Each request's prompt differs in
    its first token from the stream's previous one: no prefix-cache hits."""
    meters = {"gateway": time.process_time, **(meters or {})}
    ramp_s = plan_.ramp_s
    base = runs.workload("sc", streams, PROMPT_LEN, OUTPUT_LEN, seed, tenants=TENANTS)
    window, stop = Window(), asyncio.Event()

    async def stream(i: int, spec: runs.Spec) -> None:
        await asyncio.sleep(ramp_s * i / streams)
        k = 0
        while not stop.is_set():
            first = runs.VOCAB[0] + (i + k) % (runs.VOCAB[1] - runs.VOCAB[0])
            again = dataclasses.replace(
                spec, request_id=f"{spec.request_id}-{k}", prompt=[first, *spec.prompt[1:]]
            )
            window.traces.append(await client.generate(again))
            k += 1

    tasks = [asyncio.create_task(stream(i, s)) for i, s in enumerate(base)]
    await asyncio.sleep(ramp_s)
    window.start, before = time.perf_counter(), {k: read() for k, read in meters.items()}
    await asyncio.sleep(plan_.window_s)
    window.end = time.perf_counter()
    window.cpu_s = {k: read() - before[k] for k, read in meters.items()}
    stop.set()
    _, pending = await asyncio.wait(tasks, timeout=60.0)
    for task in pending:
        task.cancel()
    return window


def inside(windows: Sequence[Window]) -> list[runs.Trace]:
    """The requests submitted inside their round's window."""
    return [t for w in windows for t in w.traces if w.start <= t.submitted < w.end]


def measure(windows: Sequence[Window], streams: int) -> dict[str, Any]:
    """Tokens and requests that ended inside the windows, TTFT of those submitted in
    them, over the rounds' summed window time."""
    span = sum(w.end - w.start for w in windows)
    tokens = sum(
        n for w in windows for t in w.traces for at, n in t.arrivals if w.start <= at < w.end
    )
    ended = sum(
        1 for w in windows for t in w.traces if t.arrivals and w.start <= t.arrivals[-1][0] < w.end
    )
    measured = inside(windows)
    ttfts = [ms for t in measured if (ms := t.ttft_ms) is not None]
    # tokens a request that ended with "length" never delivered (a delta lost on the way)
    short = [
        t.spec.max_tokens - t.num_tokens for w in windows for t in w.traces if t.finish == "length"
    ]
    cpu_s = {k: sum(w.cpu_s[k] for w in windows) for k in windows[0].cpu_s}
    gateway_s = cpu_s["gateway"]
    # CPU per output token: the pipeline's cost, whatever the rate (`gateway` includes
    # this process's load generator: its closed loop's tasks read every event)
    per_token = {f"{k}_us_per_token": round(1e6 * v / max(tokens, 1), 1) for k, v in cpu_s.items()}
    return {
        "streams": streams,
        "rounds": len(windows),
        "window_s": round(span, 2),
        "output_tokens_per_s": round(tokens / span, 1),
        "requests_per_s": round(ended / span, 2),
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "finish_reasons": runs.summarize(measured)["finish_reasons"] if measured else {},
        "requests_short": sum(n > 0 for n in short),
        "tokens_short": sum(short),
        **{f"{k}_cores": round(v / span, 3) for k, v in cpu_s.items()},
        **per_token,
        "gateway_cpu_s_per_1000_streams": round(1000 * gateway_s / max(ended, 1), 2),
        "gateway_cores_per_1000_concurrent": round(1000 * gateway_s / span / streams, 3),
    }


async def _wait_workers(
    client: runs.PipelineClient, tap: TelemetryTap, workers: Workers, n: int, timeout_s: float
) -> set[str]:
    """Short requests from every tenant, round after round, until each of the N workers
    answered one: every member joined the group and holds partitions. A request published
    before its partition's owner resolved its position ("latest") is never read: it is
    given up after a few seconds."""
    deadline, answered = time.monotonic() + timeout_s, set[str]()
    while len(answered) < n:
        if time.monotonic() > deadline or not workers.alive():
            raise RuntimeError(f"{len(answered)}/{n} workers answered (logs: see log dir)")
        specs = runs.workload("warm", TENANTS, (16, 32), (4, 4), 1, tenants=TENANTS)
        tasks = {asyncio.create_task(client.generate(s)): s for s in specs}
        _, pending = await asyncio.wait(tasks, timeout=5.0)
        for task in pending:
            client.cancel(tasks[task].request_id)
            task.cancel()
        ids = [s.request_id for t, s in tasks.items() if t not in pending]
        await tap.wait_for(ids, 5.0)
        seen = tap.seen()
        answered |= {seen[r][0] for r in ids if r in seen}
    return answered


# -- runs -------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class Config:
    """What every stage of the run shares."""

    kafka_bootstrap: str | None  # None: a fresh Tansu per stage
    backend: str
    env: dict[str, str]
    log_dir: Path


@dataclasses.dataclass(slots=True)
class Stage:
    """One measurement's bus, telemetry tap, workers and CPU meters."""

    bus: KafkaEventBus
    tap: TelemetryTap
    workers: Workers
    meters: Meters
    partitions: int


def _start_broker(stack: ExitStack) -> tuple[str, set[int]]:
    """A Tansu of this stage's own, and its processes (for its CPU).

    Tansu 0.6's in-memory storage slows down as a partition grows (see
    `benchmarks.serving._gateway`); the telemetry, usage and request partitions grow with
    every request of a run, so each stage starts on an empty broker."""
    before = _children({os.getpid()})
    broker = stack.enter_context(TansuBroker(binary=load_settings(BusSettings).tansu_bin))
    return broker.bootstrap, _children({os.getpid()}) - before


@contextlib.asynccontextmanager
async def stage(cfg: Config, n: int, env: dict[str, str]) -> AsyncIterator[Stage]:
    """A broker (fresh unless given), N workers and a fresh gateway; all N answered."""
    with ExitStack() as stack:
        bootstrap, broker_pids = cfg.kafka_bootstrap or "", set[int]()
        if not bootstrap:
            bootstrap, broker_pids = _start_broker(stack)
        bus = KafkaEventBus(kafka_config(bootstrap, "sluice-bench-gateway"))
        stack.callback(bus.close)
        # as the workers' SLUICE_REQUEST_PARTITIONS: they check the topics they find
        layout = TopicLayout(request_partitions=PARTITIONS, pools=(POOL,))
        bus.create_topics(layout.specs())
        tap = TelemetryTap(bootstrap)
        stack.callback(tap.close)
        await asyncio.to_thread(tap.wait_listening, 60.0)
        workers = Workers(n, bootstrap, cfg.backend, {**cfg.env, **env}, cfg.log_dir)
        try:
            client = runs.PipelineClient(bus)
            await client.start()
            try:
                await _wait_workers(client, tap, workers, n, 180.0)
            finally:
                await client.close()
            meters = {
                "workers": workers.cpu_s,
                "broker": lambda: sum(cpu_ticks(p) for p in broker_pids) / CLK_TCK,
            }
            partitions = bus.num_partitions(request_topic(Lane.STANDARD, POOL))
            yield Stage(bus, tap, workers, meters, partitions)
        finally:
            await asyncio.to_thread(workers.close)


async def run_rounds(st: Stage, streams: int, plan_: Plan, seed: int) -> list[Window]:
    """The closed loop, round after round, each through a fresh gateway. A gateway's
    reply topic has one partition that takes every delta message of every worker, and
    Tansu's in-memory storage slows down as a partition grows (`benchmarks.serving.
    _gateway`): one 30 s window of 4 workers left requests 50 s without a first token."""
    windows = []
    for i in range(plan_.rounds):
        client = runs.PipelineClient(st.bus)
        await client.start()
        try:
            windows.append(await closed_loop(client, streams, plan_, seed + i, st.meters))
        finally:
            await client.close()
    return windows


async def size_run(cfg: Config, n: int, max_num_seqs: int, plan_: Plan) -> dict[str, Any]:
    streams = 2 * max_num_seqs * n
    async with stage(cfg, n, {"SLUICE_MAX_NUM_SEQS": str(max_num_seqs)}) as st:
        windows = await run_rounds(st, streams, plan_, 200 + 10 * n)
        row = {"workers": n, "partitions": st.partitions, **measure(windows, streams)}
        measured = inside(windows)
        await st.tap.wait_for([t.spec.request_id for t in measured], 15.0)
        row["by_worker"] = _by_worker(measured, st.tap.seen())
        return row


def _by_worker(
    traces: Sequence[runs.Trace], seen: dict[str, tuple[str, Timings]]
) -> dict[str, dict[str, float]]:
    """Requests and TTFT p99 per worker (from telemetry): a worker that holds more
    tenants' partitions, or stalls, shows here."""
    ttfts: dict[str, list[float]] = {}
    for t in traces:
        entry, ttft = seen.get(t.spec.request_id), t.ttft_ms
        if entry is not None and ttft is not None:
            ttfts.setdefault(entry[0].rsplit("-", 1)[-1], []).append(ttft)
    return {
        worker: {"requests": len(values), "ttft_p99_ms": round(percentile(values, 99), 1)}
        for worker, values in sorted(ttfts.items())
    }


async def probe_run(cfg: Config, plan_: Plan) -> dict[str, Any]:
    """Levels of concurrent streams over 4 roomy workers, each stream paced at
    `PROBE_STREAM_TOKENS_PER_S`, until p99 added TTFT > 50 ms, each level on a fresh
    stage."""
    room = str(max(plan_.levels))
    env = {
        "SLUICE_MAX_NUM_SEQS": room,
        "SLUICE_MAX_IN_ENGINE": room,
        "SLUICE_SIM_MIN_STEP_MS": str(1000.0 / PROBE_STREAM_TOKENS_PER_S),
    }
    limit = TARGETS["probe_added_ttft_p99_ms_max"]
    rows: list[dict[str, Any]] = []
    for level in plan_.levels:
        async with stage(cfg, 4, env) as st:
            windows = await run_rounds(st, level, plan_, 300)
            measured = inside(windows)
            await st.tap.wait_for([t.spec.request_id for t in measured], 15.0)
            rows.append({**measure(windows, level), **_added(measured, st.tap.seen())})
        if not rows[-1]["added_ttft_p99_ms"] <= limit:  # nan (no telemetry) stops it too
            break
    under = [r["streams"] for r in rows if r["added_ttft_p99_ms"] <= limit]
    return {"levels": rows, "streams_held": max(under, default=0)}


def _added(traces: Sequence[runs.Trace], seen: dict[str, tuple[str, Timings]]) -> dict[str, Any]:
    """Per request: TTFT minus the engine's part (engine submit → first token), and where
    the rest went (wall-clock ms, one clock): gateway → the worker's poll (`to_worker`),
    poll → engine submit (`in_worker`: the worker's fair queue and admission), first
    token → this process (`to_client`)."""
    spans: dict[str, list[float]] = {
        name: [] for name in ("engine", "added", "to_worker", "in_worker", "to_client")
    }
    for t in traces:
        ttft, entry = t.ttft_ms, seen.get(t.spec.request_id)
        if ttft is None or entry is None:
            continue
        tm = entry[1]
        if None in (tm.scheduled_ms, tm.first_token_ms, tm.received_ms):
            continue
        assert tm.scheduled_ms and tm.first_token_ms and tm.received_ms
        spans["engine"].append(tm.first_token_ms - tm.scheduled_ms)
        spans["added"].append(ttft - spans["engine"][-1])
        spans["to_worker"].append(tm.received_ms - tm.queued_ms)
        spans["in_worker"].append(tm.scheduled_ms - tm.received_ms)
        spans["to_client"].append(t.created_ms + ttft - tm.first_token_ms)
    out: dict[str, Any] = {"with_telemetry": len(spans["added"])}
    for name, values in spans.items():
        out[f"{name}_ttft_p50_ms" if name in ("engine", "added") else f"{name}_p50_ms"] = round(
            percentile(values, 50), 1
        )
        out[f"{name}_ttft_p99_ms" if name in ("engine", "added") else f"{name}_p99_ms"] = round(
            percentile(values, 99), 1
        )
    return out


async def _run_async(
    cfg: Config, max_num_seqs: int, plan_: Plan, sizes: Sequence[int]
) -> dict[str, Any]:
    from sluice.wiring import freeze_heap

    freeze_heap()  # this process is the gateway: as `sluice gateway` does
    result: dict[str, Any] = {"worker_logs": str(cfg.log_dir), "sizes": []}
    for n in sizes:
        result["sizes"].append(await size_run(cfg, n, max_num_seqs, plan_))
    one = result["sizes"][0]["output_tokens_per_s"]
    for row in result["sizes"]:
        row["scale_ratio"] = ratio(row["output_tokens_per_s"], one)
    result["partitions"] = min(row["partitions"] for row in result["sizes"])
    result["probe"] = {"levels": [], "streams_held": 0}
    if plan_.levels:
        result["probe"] = await probe_run(cfg, plan_)
    return result


def _checks(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    four = [r["scale_ratio"] for r in result["sizes"] if r["workers"] == 4]
    probe = result["probe"]
    return {
        "scale_ratio_4_min": {
            "value": four[0] if four else "not run",
            "target": TARGETS["scale_ratio_4_min"],
            "ok": bool(four and four[0] >= TARGETS["scale_ratio_4_min"]),
        },
        "gateway_streams_at_50ms_p99": {
            "value": probe["streams_held"],
            "target": "the last level whose p99 added TTFT <= 50 ms (a measurement)",
            "ok": probe["streams_held"] > 0,
        },
    }


def run(
    quick: bool = False,
    kafka_bootstrap: str | None = None,
    data_dir: Any = None,
    backend: str = "sim",
    sim_preset: str | None = None,
    max_num_seqs: int = 64,
    sizes: Sequence[int] = SIZES,
) -> dict[str, Any]:
    """The whole benchmark; starts a Tansu when no bootstrap is given. `backend`:
    SLUICE_BACKEND of the workers (torch for a check of the harness without the sim)."""
    started = time.perf_counter()
    env = {
        "SLUICE_DATA_DIR": str(data_dir or load_settings(CommonSettings).data_dir),
        "SLUICE_MODEL": "tiny-llama",  # the sim's tokenizer; the torch check's fast model
    }
    if sim_preset:
        env["SLUICE_SIM_PRESET"] = sim_preset
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-scale-"))
    cfg = Config(kafka_bootstrap, backend, env, log_dir)
    result = asyncio.run(_run_async(cfg, max_num_seqs, plan(quick), sizes))
    broker = kafka_bootstrap or "tansu (a fresh one per stage)"
    result.update(
        kafka_broker=broker,
        backend=backend,
        sim_preset=sim_preset or os.environ.get("SLUICE_SIM_PRESET", "the workers' default"),
        max_num_seqs=max_num_seqs,
        probe_stream_tokens_per_s=PROBE_STREAM_TOKENS_PER_S,
        tenants=TENANTS,
        prompt_len=list(PROMPT_LEN),
        output_len=list(OUTPUT_LEN),
        cores=os.cpu_count(),
        quick=quick,
    )
    result["checks"] = _checks(result)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        f"backend {result['backend']} ({result['sim_preset']}), broker {result['kafka_broker']},"
        f" {result['partitions']} partitions/lane, {result['tenants']} tenants,"
        f" max_num_seqs {result['max_num_seqs']}, {result['cores']} cores",
        f"{'workers':>7} {'streams':>7} {'tok/s':>8} {'req/s':>7} {'TTFT p50':>9} {'p99':>8}"
        f" {'scale':>6} {'gw cores':>8} {'gw cpu-s/1k':>11} {'workers':>8} {'broker':>7}"
        f" {'gw+wkr us/tok':>13} {'broker':>6} {'short':>6}",
    ]
    for r in result["sizes"]:
        lines.append(
            f"{r['workers']:>7} {r['streams']:>7} {r['output_tokens_per_s']:>8.0f}"
            f" {r['requests_per_s']:>7.1f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>8.1f}"
            f" {r['scale_ratio']:>5.2f}x {r['gateway_cores']:>8.2f}"
            f" {r['gateway_cpu_s_per_1000_streams']:>11.2f} {r['workers_cores']:>8.2f}"
            f" {r['broker_cores']:>7.2f}"
            f" {r['gateway_us_per_token'] + r['workers_us_per_token']:>13.1f}"
            f" {r['broker_us_per_token']:>6.1f} {r['tokens_short']:>6}"
        )
    lines.append(
        "short: tokens a request that ended never got; us/tok: CPU µs per output token."
        f" Gateway capacity, 4 roomy workers, streams at {PROBE_STREAM_TOKENS_PER_S:.0f}"
        " tok/s (added TTFT: TTFT - engine submit→first token)"
    )
    lines.append(
        f"{'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'engine p99':>10}"
        f" {'added p50':>9} {'p99':>8} {'to wkr p99':>10} {'to client p99':>13} {'gw cores':>8}"
        f" {'gw us/tok':>9}"
    )
    for r in result["probe"]["levels"]:
        lines.append(
            f"{r['streams']:>7} {r['output_tokens_per_s']:>8.0f} {r['ttft_p50_ms']:>9.1f}"
            f" {r['ttft_p99_ms']:>8.1f} {r['engine_ttft_p99_ms']:>10.1f}"
            f" {r['added_ttft_p50_ms']:>9.1f} {r['added_ttft_p99_ms']:>8.1f}"
            f" {r['to_worker_p99_ms']:>10.1f} {r['to_client_p99_ms']:>13.1f}"
            f" {r['gateway_cores']:>8.2f} {r['gateway_us_per_token']:>9.1f}"
        )
    for r in result["sizes"]:
        shares = ", ".join(
            f"{w} {v['requests']} req p99 {v['ttft_p99_ms']:.0f} ms"
            for w, v in r["by_worker"].items()
        )
        lines.append(f"{r['workers']} workers, by worker: {shares}")
    for name, check in result["checks"].items():
        mark = "ok  " if check["ok"] else "MISS"
        lines.append(f"[{mark}] {name}: {check['value']} (target {check['target']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="one 12 s round per size, probe from 100 (~5 min)"
    )
    parser.add_argument("--kafka", default=None, help="Kafka bootstrap; default: start a Tansu")
    parser.add_argument("--data-dir", default=None, type=Path, help="where tiny-llama lives")
    parser.add_argument("--backend", default="sim", choices=["sim", "torch"])
    parser.add_argument("--sim-preset", default=None, help="SLUICE_SIM_PRESET of the workers")
    parser.add_argument("--max-num-seqs", default=64, type=int, help="each worker's batch")
    parser.add_argument("--sizes", default="1,2,4", help="worker counts, e.g. 1,2,4")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    result = run(
        quick=args.quick,
        kafka_bootstrap=args.kafka,
        data_dir=args.data_dir,
        backend=args.backend,
        sim_preset=args.sim_preset,
        max_num_seqs=args.max_num_seqs,
        sizes=[int(n) for n in args.sizes.split(",")],
    )
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
