"""`sluice bench overload`: goodput as offered load steps past capacity, SLO-aware
admission on and off.

The gateway (`create_app` under uvicorn) and an engine worker on the memory bus in a
child process, as `sluice serve` wires them (the client, in this one, holds no GIL they
need), serving the sim backend with a scaled-down preset
(a 20 ms step plus per-request and per-token costs, 8 running slots): a GPU's shape at
a rate two cores can drive and stream, and no CPU spent on compute. The serving bench's
workload (prompt U[16,128], output U[16,96] tokens, EOS ignored), interactive lane
(`service_tier` priority), Poisson arrivals over the completions API, streamed with
httpx.

First the capacity is measured (a closed loop of twice the slots, requests completed
per second); then for each offered load (0.5x to 3x of it) the two arms run back to
back on the same seeded arrivals and requests: admission on (SLUICE_SLO_ADMISSION, the
interactive target) and off. Per step:
goodput (requests per second whose first token came within the target), the p99 TTFT
of admitted requests (a request still without a first token when the step ends counts
as infinitely late), and the share refused (429 server_overloaded). Requests still
streaming at the end of a step are dropped by the client (the gateway cancels them) and
the engine drains before the next step.

`python -m benchmarks overload [--quick] [--json]`
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import httpx
import uvicorn

from benchmarks.stats import percentile, ratio
from sluice.api.app import create_app
from sluice.api.slo import SloAdmission
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout, pool_id
from sluice.consumers.engine_worker import EngineWorker, EngineWorkerConfig
from sluice.consumers.progress import MemoryProgressStore
from sluice.engine.backends.sim.presets import SimPreset
from sluice.engine.backends.sim_backend import SimEngineBackend
from sluice.settings import GatewaySettings, Settings, load_settings
from sluice.tansu import free_port

API_KEY = "sk-overload-bench"
TARGET_S = 2.0  # the interactive lane's TTFT target
LOADS = (0.5, 1.0, 2.0, 3.0)
PROMPT_TOKENS = (16, 128)
OUTPUT_TOKENS = (16, 96)
PRESET = SimPreset(
    name="overload-small",
    base_ms=20.0,
    per_seq_us=200.0,
    per_token_us=50.0,
    per_kv_token_ns=0.0,
    per_pair_ps=0.0,
    num_kv_blocks=65_536,
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    max_model_len=2048,
)
GOALS = {"goodput_3x_vs_1x_min": 0.9, "admitted_p99_ttft_s_max": TARGET_S}


@dataclass(slots=True)
class Outcome:
    status: int = 0  # 0: no answer before the step ended
    ttft_s: float | None = None


@dataclass(slots=True)
class Stack:
    base_url: str
    slo: SloAdmission
    worker: EngineWorker

    def admission(self, on: bool) -> None:
        # the predictor keeps tracking either way; only the decision is switched
        self.slo.targets_s = {"interactive": TARGET_S} if on else {}

    def drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.worker.stats.held and time.monotonic() < deadline:
            time.sleep(0.05)


def _serve(conn: Connection) -> None:
    """The child process: the stack, driven by (command, argument) messages on `conn`."""
    with stack() as served:
        conn.send(served.base_url)
        while True:
            command, argument = conn.recv()
            if command == "stop":
                break
            if command == "admission":
                served.admission(bool(argument))
            elif command == "drain":
                served.drain()
            conn.send(None)


class Remote:
    """The stack in a child process (`_serve`)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_serve, args=(child,), name="overload-stack")
        self._proc.start()
        self.base_url: str = self._conn.recv()

    def _call(self, command: str, argument: object = None) -> None:
        self._conn.send((command, argument))
        self._conn.recv()

    def admission(self, on: bool) -> None:
        self._call("admission", on)

    def drain(self) -> None:
        self._call("drain")

    def close(self) -> None:
        self._conn.send(("stop", None))
        self._proc.join(60.0)


@contextlib.contextmanager
def stack() -> Iterator[Stack]:
    settings = load_settings(Settings, model="tiny-llama")
    from sluice import wiring

    model = wiring.served_model(settings)  # tiny-llama's tokenizer: the sim's vocabulary
    bus = MemoryEventBus()
    pool = pool_id(model.name)
    bus.create_topics(TopicLayout(request_partitions=1, pools=(pool,)).specs())
    backend = SimEngineBackend(PRESET, max_model_len=2048, tokenizer=model.tokenizer)
    config = EngineWorkerConfig()
    worker = EngineWorker(bus, backend, config, MemoryProgressStore(), "w1", pool=pool)
    worker_thread = threading.Thread(target=worker.run, name="overload-worker", daemon=True)
    worker_thread.start()
    assert worker.wait_ready(30.0), "the engine worker got no partitions"
    gateway = GatewaySettings(
        api_keys=[API_KEY], slo_admission=True, ttft_target_interactive_s=TARGET_S
    )
    app = create_app(gateway, bus, [model])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server_thread = threading.Thread(target=server.run, name="overload-gateway", daemon=True)
    server_thread.start()
    while not server.started:
        time.sleep(0.05)
    pools = app.state.gateway.service.slo
    assert pools is not None
    slo = pools.pools[pool]  # the one served model's
    try:
        yield Stack(f"http://127.0.0.1:{port}", slo, worker)
    finally:
        server.should_exit = True
        server_thread.join(10.0)
        worker.drain(10.0)
        worker_thread.join(10.0)
        bus.close()


def _body(rng: random.Random) -> dict[str, Any]:
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(*PROMPT_TOKENS))]
    return {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": rng.randint(*OUTPUT_TOKENS),
        "ignore_eos": True,
        "stream": True,
        "service_tier": "priority",
    }


async def _one(client: httpx.AsyncClient, body: dict[str, Any], outcome: Outcome) -> None:
    sent = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            outcome.status = response.status_code
            return
        outcome.status = 200
        async for line in response.aiter_lines():
            if outcome.ttft_s is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    outcome.ttft_s = time.monotonic() - sent


def _client(base_url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    headers = {"authorization": f"Bearer {API_KEY}"}
    return httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=None)


async def _capacity(base_url: str, seconds: float, rng: random.Random) -> float:
    """Requests completed per second with twice the engine's slots always in flight."""
    done = 0
    stop_at = time.monotonic() + seconds

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            outcome = Outcome()
            await _one(client, _body(rng), outcome)
            if outcome.status == 200 and time.monotonic() <= stop_at:
                done += 1

    started = time.monotonic()
    async with _client(base_url) as client:
        tasks = [asyncio.create_task(loop(client)) for _ in range(2 * PRESET.max_num_seqs)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done / (time.monotonic() - started)


async def _step(
    base_url: str, rate: float, seconds: float, grace_s: float, rng: random.Random
) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `seconds`; answers wait `grace_s` more at most."""
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    async with _client(base_url) as client:
        start = time.monotonic()
        at = start
        while True:
            at += rng.expovariate(rate)
            if at - start >= seconds:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            outcome = Outcome()
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(_one(client, _body(rng), outcome)))
        await asyncio.wait(tasks, timeout=max(0.0, start + seconds + grace_s - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return _figures(outcomes, rate, seconds)


def _figures(outcomes: list[Outcome], rate: float, seconds: float) -> dict[str, Any]:
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    met = [o for o in admitted if o.ttft_s is not None and o.ttft_s <= TARGET_S]
    ttfts = [o.ttft_s if o.ttft_s is not None else math.inf for o in admitted]
    p99 = percentile(ttfts, 99) if ttfts else math.nan
    return {
        "offered_rps": round(rate, 2),
        "sent": len(outcomes),
        "admitted": len(admitted),
        "refused_share": ratio(len(refused), len(outcomes)),
        "other_errors": len(outcomes) - len(admitted) - len(refused),
        "goodput_rps": round(len(met) / seconds, 2),
        "admitted_p99_ttft_s": round(p99, 3) if math.isfinite(p99) else None,
    }


def run(quick: bool = False) -> dict[str, Any]:
    step_s = 6.0 if quick else 12.0
    rng = random.Random(7)
    steps: list[dict[str, Any]] = []
    started = time.monotonic()
    served = Remote()
    try:
        served.admission(False)
        capacity = asyncio.run(_capacity(served.base_url, 6.0 if quick else 10.0, rng))
        served.drain()
        for load in LOADS:
            for on in (True, False):
                served.admission(on)
                arrivals = random.Random(int(load * 100))  # both arms: the same requests
                figures = asyncio.run(
                    _step(served.base_url, load * capacity, step_s, 2 * TARGET_S, arrivals)
                )
                served.drain()
                steps.append({"load": load, "admission": "on" if on else "off", **figures})
    finally:
        served.close()
    return _result(capacity, step_s, steps, time.monotonic() - started)


def _result(
    capacity: float, step_s: float, steps: list[dict[str, Any]], elapsed_s: float
) -> dict[str, Any]:
    def step(load: float, arm: str) -> dict[str, Any]:
        return next(s for s in steps if s["load"] == load and s["admission"] == arm)

    on_1x, on_3x, off_3x = step(1.0, "on"), step(3.0, "on"), step(3.0, "off")
    p99 = on_3x["admitted_p99_ttft_s"]
    measured = {
        "goodput_3x_vs_1x_on": ratio(on_3x["goodput_rps"], on_1x["goodput_rps"]),
        "goodput_3x_vs_1x_off": ratio(off_3x["goodput_rps"], step(1.0, "off")["goodput_rps"]),
        "admitted_p99_ttft_s_3x_on": p99,
    }
    return {
        "backend": f"sim ({PRESET.name}: {PRESET.base_ms:g} ms step, {PRESET.max_num_seqs} slots)",
        "ttft_target_s": TARGET_S,
        "capacity_rps": round(capacity, 2),
        "step_s": step_s,
        "steps": steps,
        "measured": measured,
        "goals": GOALS,
        "met": {
            "goodput_3x_vs_1x_min": measured["goodput_3x_vs_1x_on"]
            >= GOALS["goodput_3x_vs_1x_min"],
            "admitted_p99_ttft_s_max": p99 is not None and p99 <= TARGET_S,
        },
        "elapsed_s": round(elapsed_s, 1),
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"overload: {result['backend']}, interactive TTFT target {result['ttft_target_s']:g} s,"
        f" capacity {result['capacity_rps']} req/s, {result['step_s']:g} s per step",
        f"{'load':>5} {'admission':>9} {'offered':>8} {'sent':>5} {'refused':>8}"
        f" {'goodput':>8} {'p99 TTFT':>9}",
    ]
    for s in result["steps"]:
        p99 = s["admitted_p99_ttft_s"]
        lines.append(
            f"{s['load']:>4g}x {s['admission']:>9} {s['offered_rps']:>8} {s['sent']:>5}"
            f" {s['refused_share']:>8.0%} {s['goodput_rps']:>8} "
            + (f"{p99:>8.2f}s" if p99 is not None else f"{'none':>9}")
        )
    m = result["measured"]
    lines.append(
        f"goodput 3x/1x: on {m['goodput_3x_vs_1x_on']}, off {m['goodput_3x_vs_1x_off']}"
        f" (goal >= {result['goals']['goodput_3x_vs_1x_min']}, on); admitted p99 TTFT at 3x"
        f" (on): {m['admitted_p99_ttft_s_3x_on']} s (goal <= {result['ttft_target_s']:g} s)"
    )
    lines.append(f"met: {result['met']}  ({result['elapsed_s']} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 s steps instead of 12 s")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
