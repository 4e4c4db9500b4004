"""`sluice bench serving`, its other processes: the engine worker and the bus echo.

Distributed mode runs the gateway and the engine worker as separate processes, so the
benchmark does too (spawned, each with its own interpreter and GIL): one `EngineWorker`
over the same engine config and model as the direct arm, and an echo that republishes
each message of one topic to another, which gives the transport's own request→reply
round trip over the same broker with the same client settings.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

from benchmarks.stats import percentile
from sluice.bus.base import TopicSpec
from sluice.bus.codec import decode_as
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.messages import TelemetryRecord, Timings
from sluice.bus.topics import TELEMETRY_TOPIC, TopicLayout, pool_id

# the worker's model, as the gateway side's requests name it (`serving_runs`): its lanes
POOL = pool_id("tiny-llama")


def kafka_config(bootstrap: str, client_id: str) -> KafkaConfig:
    """The client settings every party of the benchmark uses (the bus defaults)."""
    return KafkaConfig(bootstrap=bootstrap, client_id=client_id)


def engine_config() -> Any:
    """One engine config for both arms: the worker's defaults, priority scheduling.

    Priority scheduling is what the worker's lane → priority mapping relies on
    (`consumers.worker_requests.LANE_PRIORITY`); fcfs would ignore it.
    """
    from sluice.engine.config import EngineConfig

    return EngineConfig(scheduling_policy="priority")


def worker_threads() -> int:
    """The worker's torch threads as `sluice worker engine` picks them on CPU
    (`SLUICE_TORCH_THREADS`, else every core but one). The direct arm runs the engine
    with the same count: the same engine both ways. (It had 2 on this 2-core VM, its
    best on the AVX-512 day; on the AVX2 day 2 threads were its worst: at 10 req/s TTFT
    p50 13-18 ms against 7 ms with 1, and 1,500-1,900 tok/s at 80 req/s against
    3,400-3,800, which flattered every pipeline/direct ratio.)"""
    from sluice.settings import ModelSettings, load_settings
    from sluice.wiring import resolve_torch_threads

    return resolve_torch_threads(load_settings(ModelSettings), "cpu") or 1


def engine_process() -> bool:
    """Whether the worker runs its engine in a process of its own, as `sluice worker
    engine` does by the same setting (SLUICE_ENGINE_PROCESS, default true)."""
    from sluice.settings import ModelSettings, load_settings

    return load_settings(ModelSettings).engine_process


def engine_options(cpus: frozenset[int] | None, **overrides: Any) -> Any:
    """The engine's runtime options as `sluice worker engine` builds them from the
    settings (SLUICE_ENGINE_KERNELS, SLUICE_ENGINE_PREPACK, ...), on CPU with
    `worker_threads()` threads and the engine on `cpus`; `overrides` replace fields."""
    import dataclasses

    from sluice.settings import ModelSettings, load_settings

    options = load_settings(ModelSettings).engine_options(worker_threads(), cpus)
    return dataclasses.replace(options, **overrides)


def _worker_main(
    bootstrap: str,
    data_dir: str,
    group_id: str,
    engine_cpus: frozenset[int] | None,
    ready: MpEvent,
    stop: MpEvent,
) -> None:
    from sluice.engine.backends.torch_backend import apply_process_options
    from sluice.engine.options import apply_switch_interval
    from sluice.wiring import freeze_heap

    # this process is a composition root: its process-wide effects as `sluice worker
    # engine` applies them (`sluice.wiring.apply_process_effects`); it started on the
    # other cores, and the engine (its thread, or its process) moves to `engine_cpus`
    options = engine_options(engine_cpus)
    apply_switch_interval(options)
    apply_process_options(options)
    from sluice.consumers.engine_worker import EngineWorker, EngineWorkerConfig
    from sluice.consumers.progress import MemoryProgressStore
    from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend
    from sluice.engine.backends.torch_backend import TorchEngineBackend

    bus = KafkaEventBus(kafka_config(bootstrap, "sluice-bench-worker"))
    bus.create_topics(TopicLayout(pools=(POOL,)).specs())
    backend: Any
    if engine_process():  # as `sluice worker engine` runs it
        spec = EngineSpec("tiny-llama", engine_config(), data_dir, options=options)
        backend = ProcessEngineBackend(spec)
    else:
        backend = TorchEngineBackend.from_model(
            "tiny-llama", config=engine_config(), data_dir=data_dir, options=options
        )
    config = EngineWorkerConfig(group_id=group_id)
    worker = EngineWorker(bus, backend, config, MemoryProgressStore(), "bench-w0", pool=POOL)
    freeze_heap()  # as `sluice worker engine` does
    thread = threading.Thread(target=worker.run, name="bench-worker", daemon=True)
    thread.start()
    if worker.wait_ready(60.0):
        ready.set()
    stop.wait()
    worker.drain(5.0)
    bus.close()


def _echo_main(
    bootstrap: str, topic_in: str, topic_out: str, ready: MpEvent, stop: MpEvent
) -> None:
    bus = KafkaEventBus(kafka_config(bootstrap, "sluice-bench-echo"))
    consumer = bus.consumer(f"echo-{uuid.uuid4().hex[:8]}", [topic_in], offset_reset="latest")
    try:
        while not stop.is_set():
            records = consumer.poll(0.1, 500)
            if consumer.assignment():
                ready.set()
            for record in records:
                bus.publish(topic_out, record.value, key=record.key)
    finally:
        consumer.close()
        bus.close()


@dataclass(slots=True)
class Child:
    """A spawned process with a ready and a stop event."""

    process: Any
    ready: MpEvent
    stop: MpEvent

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{self.process.name} did not become ready")

    def close(self, timeout_s: float = 20.0) -> None:
        self.stop.set()
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)


def spawn(name: str, target: Callable[..., None], *args: Any, daemon: bool = True) -> Child:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    process = ctx.Process(target=target, args=(*args, ready, stop), name=name, daemon=daemon)
    process.start()
    return Child(process, ready, stop)


def start_worker(
    bootstrap: str, data_dir: str, group_id: str, engine_cpus: frozenset[int] | None
) -> Child:
    # not daemonic: a daemonic process may not start the engine process
    return spawn(
        "sluice-bench-worker",
        _worker_main,
        bootstrap,
        data_dir,
        group_id,
        engine_cpus,
        daemon=False,
    )


def bus_round_trip(bootstrap: str, count: int, rate_per_s: float) -> dict[str, Any]:
    """Request → echo (another process) → reply over the same broker, paced, p50/p99."""
    run = uuid.uuid4().hex[:8]
    topic_in, topic_out = f"bench.echo.{run}.in.v1", f"bench.echo.{run}.out.v1"
    bus = KafkaEventBus(kafka_config(bootstrap, "sluice-bench-rtt"))
    bus.create_topics([TopicSpec(topic_in, 1), TopicSpec(topic_out, 1)])
    echo = spawn("sluice-bench-echo", _echo_main, bootstrap, topic_in, topic_out)
    arrivals: dict[int, int] = {}
    listening, done = threading.Event(), threading.Event()

    def listen() -> None:
        consumer = bus.consumer(f"rtt-{run}", [topic_out], offset_reset="latest")
        try:
            while not done.is_set():
                records = consumer.poll(0.1, 500)
                now = time.perf_counter_ns()
                if consumer.assignment():
                    listening.set()
                for record in records:
                    arrivals[int(record.value[:20])] = now
        finally:
            consumer.close()

    thread = threading.Thread(target=listen, name="bench-rtt", daemon=True)
    thread.start()
    try:
        echo.wait_ready(60.0)
        listening.wait(60.0)
        time.sleep(1.0)  # both positions resolved ("latest") before the first message
        sent: dict[int, int] = {}
        filler = b"x" * 492  # ~ the size of a GenerateRequest
        for i in range(count + 20):  # the first 20 warm the path up, not measured
            sent[i] = time.perf_counter_ns()
            bus.publish(topic_in, f"{i:020d}".encode() + filler, key=b"bench")
            time.sleep(1.0 / rate_per_s)
        deadline = time.monotonic() + 10.0
        while len(arrivals) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        thread.join(5.0)
        echo.close()
        bus.close()
    rtt_ms = [(arrivals[i] - sent[i]) / 1e6 for i in range(20, count + 20) if i in arrivals]
    return {
        "messages": count,
        "received": len(rtt_ms),
        "rate_per_s": rate_per_s,
        "p50_ms": round(percentile(rtt_ms, 50), 2),
        "p99_ms": round(percentile(rtt_ms, 99), 2),
        "max_ms": round(max(rtt_ms), 2) if rtt_ms else None,
    }


HOPS = ("to_engine", "engine", "to_client")


def telemetry_hops(
    bootstrap: str, first_token_ms: dict[str, int], timeout_s: float = 15.0
) -> dict[str, Any]:
    """Where the TTFT of pipeline requests goes, from the worker's telemetry (wall-clock
    ms, one clock on one machine): gateway → engine submit (`to_engine`: the gateway's
    publish, the bus hop, the worker's poll and admission), submit → the worker's loop
    holding the first token (`engine`: the wait for the step in progress and the
    prefill step), and → the client (`to_client`: the worker's publish, the bus hop back,
    the gateway's routing). p50/p99 of each over the requests found."""
    bus = KafkaEventBus(kafka_config(bootstrap, "sluice-bench-hops"))
    consumer = bus.consumer(f"hops-{uuid.uuid4().hex[:8]}", [TELEMETRY_TOPIC])
    timings: dict[str, Timings] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(timings) < len(first_token_ms) and time.monotonic() < deadline:
            for record in consumer.poll(0.2, 500):
                telemetry = decode_as(TelemetryRecord, record.value)
                if telemetry.request_id in first_token_ms and telemetry.attempt == 0:
                    timings[telemetry.request_id] = telemetry.timings
    finally:
        consumer.close()
        bus.close()
    spans: dict[str, list[float]] = {name: [] for name in HOPS}
    for request_id, t in timings.items():
        if t.scheduled_ms is None or t.first_token_ms is None:
            continue
        spans["to_engine"].append(t.scheduled_ms - t.queued_ms)
        spans["engine"].append(t.first_token_ms - t.scheduled_ms)
        spans["to_client"].append(first_token_ms[request_id] - t.first_token_ms)
    out: dict[str, Any] = {"requests": len(spans["engine"])}
    for name, values in spans.items():
        out[name] = {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}
    return out
