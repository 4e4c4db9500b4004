"""`sluice bench bus`: produce→consume latency and throughput, memory vs Kafka side by side.

Latency: one producer publishes paced messages stamped with `perf_counter_ns`; a consumer
thread in the same process records arrival minus stamp (one-way, no clock skew). Throughput:
N messages of 1 KiB as fast as the producer takes them, until the consumer has them all.
Kafka is the configured broker, or a Tansu started for the run.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import ExitStack
from typing import Any

from benchmarks.stats import percentile, ratio
from sluice.bus.base import EventBus, TopicSpec
from sluice.bus.kafka import KafkaConfig, KafkaEventBus
from sluice.bus.memory import MemoryEventBus
from sluice.settings import BusSettings, load_settings
from sluice.tansu import TansuBroker


def _consume(
    bus: EventBus,
    topic: str,
    expected: int,
    arrivals: list[tuple[int, bytes]],
    ready: threading.Event,
    timeout_s: float,
) -> None:
    consumer = bus.consumer(f"bench-{uuid.uuid4().hex[:8]}", [topic], offset_reset="earliest")
    deadline = time.monotonic() + timeout_s
    try:
        while len(arrivals) < expected and time.monotonic() < deadline:
            records = consumer.poll(0.05, 2000)
            now = time.perf_counter_ns()
            if not ready.is_set() and consumer.assignment():
                ready.set()
            arrivals.extend((now, r.value) for r in records)
    finally:
        ready.set()
        consumer.close()


def _run_phase(
    bus: EventBus, count: int, payload: int, pace_s: float, timeout_s: float
) -> dict[str, float]:
    topic = f"bench.bus.{uuid.uuid4().hex[:8]}.v1"
    bus.create_topics([TopicSpec(topic, 1)])
    arrivals: list[tuple[int, bytes]] = []
    ready = threading.Event()
    thread = threading.Thread(
        target=_consume, args=(bus, topic, count, arrivals, ready, timeout_s), daemon=True
    )
    thread.start()
    ready.wait(timeout_s)
    # A warm-up message absorbs the first fetch's set-up cost.
    bus.publish(topic, b"w" * 16 + b"x" * (payload - 16), key=b"k").result(30)
    while not arrivals and thread.is_alive():
        time.sleep(0.001)
    filler = b"x" * max(0, payload - 16)
    start = time.perf_counter_ns()
    for _ in range(count - 1):
        stamp = time.perf_counter_ns().to_bytes(16, "big")
        bus.publish(topic, stamp + filler, key=b"k")
        if pace_s:
            time.sleep(pace_s)
    bus.flush()
    thread.join(timeout_s)
    got = [(t, v) for t, v in arrivals if not v.startswith(b"w")]
    latencies_ms = [(t - int.from_bytes(v[:16], "big")) / 1e6 for t, v in got]
    elapsed_s = (max(t for t, _ in got) - start) / 1e9 if got else float("nan")
    return {
        "received": len(got),
        "sent": count - 1,
        "p50_ms": round(percentile(latencies_ms, 50), 3),
        "p99_ms": round(percentile(latencies_ms, 99), 3),
        "msgs_per_s": round(len(got) / elapsed_s, 1) if got else 0.0,
    }


def measure(
    bus: EventBus, latency_messages: int, throughput_messages: int, payload: int = 1024
) -> dict[str, float]:
    latency = _run_phase(bus, latency_messages, payload, pace_s=0.002, timeout_s=120)
    throughput = _run_phase(bus, throughput_messages, payload, pace_s=0.0, timeout_s=300)
    return {
        "latency_p50_ms": latency["p50_ms"],
        "latency_p99_ms": latency["p99_ms"],
        "msgs_per_s": throughput["msgs_per_s"],
        "lost": int(
            latency["sent"] - latency["received"] + throughput["sent"] - throughput["received"]
        ),
    }


def run(kafka_bootstrap: str | None = None, quick: bool = False) -> dict[str, Any]:
    """Measure both backends; start a Tansu when no bootstrap is given."""
    latency_n, throughput_n = (300, 5000) if quick else (1000, 20000)
    result: dict[str, Any] = {"payload_bytes": 1024, "backends": {}}
    memory = MemoryEventBus()
    result["backends"]["memory"] = measure(memory, latency_n, throughput_n)
    memory.close()
    with ExitStack() as stack:
        if kafka_bootstrap is None:
            kafka_bootstrap = stack.enter_context(
                TansuBroker(binary=load_settings(BusSettings).tansu_bin)
            ).bootstrap
            result["kafka_broker"] = "tansu (started for this run)"
        else:
            result["kafka_broker"] = kafka_bootstrap
        kafka = KafkaEventBus(KafkaConfig(bootstrap=kafka_bootstrap, client_id="sluice-bench"))
        try:
            result["backends"]["kafka"] = measure(kafka, latency_n, throughput_n)
        finally:
            kafka.close()
    mem, kaf = result["backends"]["memory"], result["backends"]["kafka"]
    result["ratios"] = {
        "kafka_vs_memory_p50_latency": ratio(kaf["latency_p50_ms"], mem["latency_p50_ms"]),
        "kafka_vs_memory_p99_latency": ratio(kaf["latency_p99_ms"], mem["latency_p99_ms"]),
        "kafka_vs_memory_throughput": ratio(kaf["msgs_per_s"], mem["msgs_per_s"]),
    }
    return result


def render(result: dict[str, Any]) -> str:
    lines = [f"{'backend':<8} {'p50 ms':>9} {'p99 ms':>9} {'msgs/s':>10} {'lost':>5}"]
    for name, row in result["backends"].items():
        lines.append(
            f"{name:<8} {row['latency_p50_ms']:>9.3f} {row['latency_p99_ms']:>9.3f} "
            f"{row['msgs_per_s']:>10.0f} {row['lost']:>5}"
        )
    for key, value in result["ratios"].items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)
