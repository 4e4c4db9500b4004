"""`sluice bench serving`, its clients and runs: one workload, two ways to the engine.

`DirectClient` submits to a `TorchEngineBackend` in this process; `PipelineClient` is
the gateway's own `GatewayService` (publish to the lane topic keyed by tenant, deltas
back on its reply topic) in front of an engine worker in another process. Both return
a `Trace` per request: submit time and the arrival time of every token delivery, taken
on this process's event loop, so TTFT is measured from before the publish.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks.stats import percentile
from sluice.api.service import GatewayService
from sluice.bus.base import EventBus
from sluice.bus.messages import GenerateRequest, SamplingSpec, TokenDelta
from sluice.bus.topics import Lane
from sluice.consumers.worker_requests import LANE_PRIORITY
from sluice.engine.backends.base import EngineRequest
from sluice.engine.sampling import SamplingParams

VOCAB = (5, 500)  # token ids drawn from the tiny-llama vocabulary (512), specials left out


@dataclass(frozen=True, slots=True)
class Spec:
    request_id: str
    prompt: list[int]
    max_tokens: int
    tenant: str = "bench"
    lane: Lane = Lane.STANDARD


@dataclass(slots=True)
class Trace:
    spec: Spec
    submitted: float = 0.0  # perf_counter seconds
    created_ms: int = 0  # the request's wall-clock creation (pipeline only), for `hops`
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, num tokens)
    finish: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft_ms(self) -> float | None:
        return (self.arrivals[0][0] - self.submitted) * 1e3 if self.arrivals else None


class Client(Protocol):
    async def generate(self, spec: Spec, trace: Trace | None = None) -> Trace: ...

    def cancel(self, request_id: str) -> None: ...

    async def wait_terminals(self, request_ids: Sequence[str], timeout_s: float) -> bool: ...


class _Terminals:
    """Request ids whose terminal delta arrived (also after a cancel)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    async def wait(self, request_ids: Sequence[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.ids.issuperset(request_ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.ids.issuperset(request_ids)


class DirectClient:
    """The engine called in-process: submit, and route its delta batches per request."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._live: dict[str, tuple[Trace, asyncio.Event]] = {}
        self._terminals = _Terminals()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.backend.start()
        self._task = asyncio.create_task(self._route(), name="bench-direct-deltas")

    async def _route(self) -> None:
        async for batch in self.backend.deltas():
            now = time.perf_counter()
            for delta in batch:
                entry = self._live.get(delta.request_id)
                if delta.finished:
                    self._terminals.ids.add(delta.request_id)
                if entry is None:
                    continue
                trace, done = entry
                if delta.token_ids:
                    trace.arrivals.append((now, len(delta.token_ids)))
                if delta.finished:
                    trace.finish = delta.finish_reason
                    del self._live[delta.request_id]
                    done.set()

    async def generate(self, spec: Spec, trace: Trace | None = None) -> Trace:
        trace, done = trace or Trace(spec), asyncio.Event()
        self._live[spec.request_id] = (trace, done)
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
        trace.submitted = time.perf_counter()
        self.backend.submit(
            EngineRequest(
                spec.request_id, list(spec.prompt), params, priority=LANE_PRIORITY[spec.lane]
            )
        )
        await done.wait()
        return trace

    def cancel(self, request_id: str) -> None:
        self.backend.abort(request_id)

    async def wait_terminals(self, request_ids: Sequence[str], timeout_s: float) -> bool:
        return await self._terminals.wait(request_ids, timeout_s)

    def close(self) -> None:
        self.backend.shutdown(5.0)
        if self._task is not None:
            self._task.cancel()


class PipelineClient:
    """The gateway's `GatewayService`, driven without HTTP."""

    def __init__(self, bus: EventBus) -> None:
        self.service = GatewayService(bus, gateway_id=f"bench-{uuid.uuid4().hex[:8]}")
        self._generations: dict[str, Any] = {}
        self._terminals = _Terminals()
        self.service.watch_terminals(self._on_terminal)

    def _on_terminal(self, request: GenerateRequest, delta: TokenDelta) -> None:
        self._terminals.ids.add(request.request_id)

    async def start(self) -> None:
        await self.service.start(60.0)

    async def generate(self, spec: Spec, trace: Trace | None = None) -> Trace:
        trace = trace or Trace(spec)
        request = GenerateRequest(
            request_id=spec.request_id,
            tenant_id=spec.tenant,
            model="tiny-llama",
            lane=spec.lane,
            prompt_token_ids=list(spec.prompt),
            sampling=SamplingSpec(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True),
            reply_to=self.service.gateway_id,
            created_ms=int(time.time() * 1000),
        )
        trace.created_ms = request.created_ms or 0
        trace.submitted = time.perf_counter()
        generation = await self.service.submit([request], None)
        self._generations[spec.request_id] = generation
        try:
            while True:
                event = await generation.next_event(120.0)
                if event is None:
                    trace.finish = "timeout"
                    break
                if event.token_ids:
                    trace.arrivals.append((time.perf_counter(), len(event.token_ids)))
                if event.finish_reason is not None:
                    trace.finish = event.finish_reason
                    break
        finally:
            self._generations.pop(spec.request_id, None)
        return trace

    def cancel(self, request_id: str) -> None:
        generation = self._generations.pop(request_id, None)
        if generation is not None:
            generation.abandon("bench: backlog no longer needed")

    async def wait_terminals(self, request_ids: Sequence[str], timeout_s: float) -> bool:
        return await self._terminals.wait(request_ids, timeout_s)

    async def close(self) -> None:
        await self.service.stop()


# -- workloads --------------------------------------------------------------------------
def workload(
    tag: str,
    n: int,
    prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int,
    *,
    tenant: str = "bench",
    lane: Lane = Lane.STANDARD,
    tenants: int = 1,
) -> list[Spec]:
    """n requests, lengths uniform in the ranges; request ids unique per call; with
    `tenants` > 1 the requests take turns among `tenant-0` … (keyed to several partitions)."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:6]
    return [
        Spec(
            f"{tag}-{run}-{i}",
            [rng.randrange(*VOCAB) for _ in range(rng.randint(*prompt_len))],
            rng.randint(*max_tokens),
            f"{tenant}-{i % tenants}" if tenants > 1 else tenant,
            lane,
        )
        for i in range(n)
    ]


def poisson_offsets(n: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate_per_s)
    return offsets


def fixed_offsets(n: int, rate_per_s: float) -> list[float]:
    return [i / rate_per_s for i in range(n)]


def start_open_loop(
    client: Client, specs: Sequence[Spec], offsets: Sequence[float]
) -> asyncio.Task[list[Trace]]:
    """Submit each spec at its offset from now (open loop); the task gathers the traces."""

    async def drive() -> list[Trace]:
        start = time.perf_counter()
        tasks = []
        for spec, offset in zip(specs, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(client.generate(spec)))
        return list(await asyncio.gather(*tasks))

    return asyncio.create_task(drive())


async def open_loop(client: Client, specs: Sequence[Spec], offsets: Sequence[float]) -> list[Trace]:
    return await start_open_loop(client, specs, offsets)


# -- metrics ----------------------------------------------------------------------------
def summarize(traces: Sequence[Trace]) -> dict[str, Any]:
    """TTFT and ITL (gaps between deliveries, per request) p50/p99, tokens/s over the run."""
    return summarize_rounds([traces])


def summarize_rounds(rounds: Sequence[Sequence[Trace]]) -> dict[str, Any]:
    """`summarize` over rounds run one after another: percentiles over every request,
    tokens/s as all tokens over the rounds' summed wall time (first submit to last token)."""
    traces = [t for r in rounds for t in r]
    ttfts = [t.ttft_ms for t in traces if t.ttft_ms is not None]
    itls = [
        (b[0] - a[0]) * 1e3
        for t in traces
        for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)
    ]
    tokens = sum(t.num_tokens for t in traces)
    wall_s = sum(_wall_s(r) for r in rounds)
    expected = sum(t.spec.max_tokens for t in traces)
    return {
        "requests": len(traces),
        "completed": sum(t.finish == "length" for t in traces),
        "finish_reasons": dict(Counter(str(t.finish) for t in traces)),
        "tokens": tokens,
        "tokens_expected": expected,
        "ttft_p50_ms": round(percentile(ttfts, 50), 2),
        "ttft_p99_ms": round(percentile(ttfts, 99), 2),
        "itl_p50_ms": round(percentile(itls, 50), 2),
        "itl_p99_ms": round(percentile(itls, 99), 2),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "wall_s": round(wall_s, 2),
    }


def _wall_s(traces: Sequence[Trace]) -> float:
    ends = [t.arrivals[-1][0] for t in traces if t.arrivals]
    return max(ends) - min(t.submitted for t in traces) if ends else float("nan")


# -- priority and fairness (through the pipeline) ----------------------------------------
async def _cancel_rest(
    client: Client, tasks: Sequence[asyncio.Task[Trace]], ids: list[str]
) -> bool:
    """Cancel what is still running, then wait until the engine answered every request."""
    for spec_id, task in zip(ids, tasks, strict=True):
        if not task.done():
            client.cancel(spec_id)
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return await client.wait_terminals(ids, 30.0)


BACKLOG_LEAD_S = 2.0  # the engine fills up with batch requests before the window opens
BACKLOG_OUTPUT = 256  # tokens per batch request


def first_token_ms(traces: Sequence[Trace]) -> dict[str, int]:
    """Wall-clock ms at which each pipeline request's first token reached the client."""
    return {
        t.spec.request_id: t.created_ms + round(ttft)
        for t in traces
        if (ttft := t.ttft_ms) is not None and t.created_ms
    }


async def priority_run(
    gateway: Callable[[], AbstractAsyncContextManager[Client]],
    quick: bool,
    capacity_tok_s: float = 0.0,
) -> dict[str, Any]:
    """Interactive TTFT alone, then beside a batch-lane backlog that saturates the engine;
    each half through a fresh `gateway()` (see `benchmarks.serving._gateway`).

    `capacity_tok_s`: the most tokens/s the engine gave in this run; the backlog holds 1.5x
    what it could generate over the lead and the window (240 fixed requests ran dry
    before the window closed on a faster day of this VM, 4,400 tok/s)."""
    # 120 requests: p99 is the 2nd slowest (of 50 it was the slowest, and the ratio of two
    # maxima swung 1.2-2.3 between runs of one build)
    n_i, rate_i = (120, 6.0) if quick else (240, 6.0)
    span_s = BACKLOG_LEAD_S + n_i / rate_i
    n_b = max(240 if quick else 480, math.ceil(1.5 * capacity_tok_s * span_s / BACKLOG_OUTPUT))

    def interactive(seed: int) -> list[Spec]:
        return workload("int", n_i, (16, 64), (32, 32), seed, tenant="t-int", lane=Lane.INTERACTIVE)

    async with gateway() as client:
        alone = await open_loop(client, interactive(11), fixed_offsets(n_i, rate_i))
    # one gateway for the backlog and the interactive requests: with a second one for the
    # backlog (its reply topic then short), the broker answered a second reply consumer's
    # fetches on the cores the hops run on, and the worker sent two messages per interval
    # instead of one: the loaded half's gateway → engine hop p50/p99 11-12 / 26-39 ms in
    # two runs, against 8-9 / 17-21 ms in four runs with one gateway
    async with gateway() as client:
        out = await _priority_loaded(client, n_i, rate_i, n_b, interactive, summarize(alone))
    out["first_token_ms"] = {"unloaded": first_token_ms(alone), **out["first_token_ms"]}
    return out


async def _priority_loaded(
    client: Client,
    n_i: int,
    rate_i: float,
    n_b: int,
    interactive: Callable[[int], list[Spec]],
    unloaded: dict[str, Any],
) -> dict[str, Any]:
    out = (BACKLOG_OUTPUT, BACKLOG_OUTPUT)
    backlog = workload("bulk", n_b, (128, 128), out, 12, tenant="t-bulk", lane=Lane.BATCH)
    bulk_traces = [Trace(s) for s in backlog]
    bulk = [
        asyncio.create_task(client.generate(s, t))
        for s, t in zip(backlog, bulk_traces, strict=True)
    ]
    await asyncio.sleep(BACKLOG_LEAD_S)
    window_start = time.perf_counter()
    loaded = await open_loop(client, interactive(11), fixed_offsets(n_i, rate_i))
    window_end = time.perf_counter()
    left = sum(not t.done() for t in bulk)
    settled = await _cancel_rest(client, bulk, [s.request_id for s in backlog])
    bulk_tokens = sum(
        n for t in bulk_traces for at, n in t.arrivals if window_start <= at <= window_end
    )
    loaded_summary = summarize(loaded)
    return {
        "interactive_requests": n_i,
        "interactive_rate_per_s": rate_i,
        "batch_backlog": n_b,
        "batch_left_at_window_end": left,
        "backlog_held": left > 0,
        "settled_after_cancel": settled,
        "unloaded": unloaded,
        "loaded": loaded_summary,
        "batch_tokens_per_s_in_window": round(bulk_tokens / (window_end - window_start), 1),
        "ttft_p99_ratio": round(loaded_summary["ttft_p99_ms"] / unloaded["ttft_p99_ms"], 3),
        "first_token_ms": {"loaded": first_token_ms(loaded)},
    }


async def fairness_run(client: Client, quick: bool) -> dict[str, Any]:
    """Tenants A and B on one lane, A sending 10x B's requests of the same size, at once."""
    n_b = 60 if quick else 100  # B stays backlogged for seconds, beyond the first burst
    specs_a = workload("fa", 10 * n_b, (64, 64), (64, 64), 21, tenant="tenant-a")
    specs_b = workload("fb", n_b, (64, 64), (64, 64), 22, tenant="tenant-b")
    order = [s for i in range(n_b) for s in (*specs_a[10 * i : 10 * i + 10], specs_b[i])]
    traces = {s.request_id: Trace(s) for s in order}
    tasks = [asyncio.create_task(client.generate(s, traces[s.request_id])) for s in order]
    b_ids = {s.request_id for s in specs_b}
    await asyncio.wait(
        [t for s, t in zip(order, tasks, strict=True) if s.request_id in b_ids], timeout=120.0
    )
    traces_b = [traces[s.request_id] for s in specs_b]
    traces_a = [traces[s.request_id] for s in specs_a]
    settled = await _cancel_rest(client, tasks, [s.request_id for s in order])
    # both tenants are backlogged until B's last request starts (its first token)
    window_start = min(t.submitted for t in traces.values())
    window_end = max((t.arrivals[0][0] for t in traces_b if t.arrivals), default=window_start)

    def tokens(traces: Sequence[Trace]) -> int:
        return sum(n for t in traces for at, n in t.arrivals if at <= window_end)

    tok_a, tok_b = tokens(traces_a), tokens(traces_b)
    return {
        "tenant_a_requests": len(specs_a),
        "tenant_b_requests": n_b,
        "b_completed": sum(t.finish == "length" for t in traces_b),
        "a_completed": sum(t.finish == "length" for t in traces_a),
        "window_s": round(window_end - window_start, 2),
        "tokens_a": tok_a,
        "tokens_b": tok_b,
        "b_share": round(tok_b / (tok_a + tok_b), 3) if tok_a + tok_b else float("nan"),
        "settled_after_cancel": settled,
    }
