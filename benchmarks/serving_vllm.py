"""`sluice bench serving --vllm`: `sluice serve` against vLLM's CPU server, side by side.

Both servers on the same model directory and dtype, started together, loaded one at a
time in rounds that alternate which goes first (a machine that slows down for a while
slows both), over HTTP with the same streaming completions (token-id prompts, exact
output lengths with `ignore_eos`, greedy, `stream_options.include_usage`):

- burst: `burst` requests at once (prompt U[16, 128], output U[16, 256] tokens, as the
  engine benchmark's mixed workload): output tokens/s over the burst's wall time (the
  saturation figure), TTFT p50/p99;
- Poisson: a light rate the engines keep up with: TTFT p50/p99 and tokens/s.

The model is the engine benchmark's (`benchmarks.engine.BENCH_MODEL`: the tiny-llama
machinery at hidden 512, 8 layers, a 32,000-token vocabulary, random weights). TTFT is the
time to the first chunk with text; that preset's tokenizer names 512 of the 32,000 ids, so
most generated ids would decode to no text: the run serves a copy of the directory whose
tokenizer names every id (`full_vocab_dir`: the same weights, linked), so every token has
text on both servers.

vLLM runs from `.peers/vllm` (`scripts/peers vllm`), never from the project's
environment; its worker busy-polls for about a second after its last request, so each
arm's phase is followed by a pause before the other's. Sluice runs with its defaults.

`python -m benchmarks.serving_vllm [--quick] [--json]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.http_servers import Launch, Server, servers
from benchmarks.observability import Result, arrivals, cpu_seconds, stream_one
from benchmarks.stats import percentile, ratio
from benchmarks.vllm_peer import INSTALL_HINT, PEER_PYTHON
from sluice.tansu import free_port

TARGETS = {"burst_tokens_per_s_vs_vllm_min": 1.1, "burst_ttft_p99_vs_vllm_max": 1.0}
MODEL = "tiny-llama"
API_KEY = "sk-bench-vllm"
ENDPOINT = "/v1/completions"
ARMS = ("sluice", "vllm")
PAUSE_S = 3.0  # vLLM's worker busy-polls ~1 s after its last request


@dataclass(frozen=True, slots=True)
class Plan:
    rounds: int  # per arm
    burst: int  # requests sent at once
    max_prompt: int
    max_output: int
    rate: float  # requests/s of the Poisson phase
    poisson_s: float
    poisson_output: int


PLANS = {
    "quick": Plan(rounds=2, burst=64, max_prompt=128, max_output=128, rate=2.0, poisson_s=15.0,
                  poisson_output=64),
    "full": Plan(rounds=3, burst=64, max_prompt=128, max_output=256, rate=2.0, poisson_s=30.0,
                 poisson_output=128),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """vLLM's server settings (the issue's measurement: max 64 sequences, 2,048 batched
    tokens). `threads_bind`: VLLM_CPU_OMP_THREADS_BIND; None leaves vLLM's default."""

    dtype: str = "bfloat16"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kvcache_space_gib: int = 1
    threads_bind: str | None = None


# -- the model ------------------------------------------------------------------------
def full_vocab_dir(src: Path, dst: Path) -> Path:
    """`src` with a tokenizer that names every id of the model's vocabulary: the ids past
    the tokenizer's own decode to a word each (" w<id>"); the weights are linked."""
    config = json.loads((src / "config.json").read_text())
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    for i in range(config["vocab_size"]):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i  # "Ġ" is a space to the ByteLevel decoder
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = dst / item.name
        if item.name == "tokenizer.json" or target.exists():
            continue
        if item.suffix == ".safetensors":
            target.symlink_to(item.resolve())
        else:
            shutil.copy2(item, target)
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dst


# -- the servers ----------------------------------------------------------------------
def launches(model_dir: Path, workdir: Path, peer: PeerSettings) -> dict[str, Launch]:
    """Each arm's command line, environment, port and readiness path."""
    ports = {arm: free_port() for arm in ARMS}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLUICE_", "VLLM_"))}
    sluice = [sys.executable, "-m", "sluice", "serve", "--model", str(model_dir),
              "--served-model-name", MODEL, "--dtype", peer.dtype, "--port",
              str(ports["sluice"]), "--data-dir", str(workdir / "data-sluice"), "--api-key",
              API_KEY]  # fmt: skip
    vllm = [str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_dir), "--served-model-name", MODEL, "--dtype", peer.dtype, "--port",
            str(ports["vllm"]), "--host", "127.0.0.1", "--api-key", API_KEY,
            "--max-num-seqs", str(peer.max_num_seqs), "--max-num-batched-tokens",
            str(peer.max_num_batched_tokens), "--max-model-len", "4096"]  # fmt: skip
    vllm_env = {**env, "VLLM_CPU_KVCACHE_SPACE": str(peer.kvcache_space_gib)}
    if peer.threads_bind is not None:
        vllm_env["VLLM_CPU_OMP_THREADS_BIND"] = peer.threads_bind
    return {
        "sluice": Launch(sluice, env, ports["sluice"]),
        "vllm": Launch(vllm, vllm_env, ports["vllm"], "/health"),
    }


# -- the workload -----------------------------------------------------------------------
def bodies(n: int, max_prompt: int, max_output: int, vocab: int, seed: int,
           fixed_output: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """n streaming completions over seeded token ids: prompt U[16, max_prompt], output
    U[16, max_output] (or `fixed_output`) tokens, exact."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(16, max_prompt))]
        tokens = fixed_output or rng.randint(16, max_output)
        out.append(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return out


@dataclass(slots=True)
class ArmFigures:
    burst_ttfts_ms: list[float] = field(default_factory=list)
    burst_tokens: int = 0
    burst_wall_s: float = 0.0
    burst_tok_s_rounds: list[float] = field(default_factory=list)
    poisson_ttfts_ms: list[float] = field(default_factory=list)
    poisson_tokens: int = 0
    poisson_wall_s: float = 0.0
    failed: int = 0
    requests: int = 0
    cpu_s: float = 0.0  # the server and its descendants, over its own phases

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return round(percentile(xs, q), 1)

        return {
            "burst_tokens_per_s": round(self.burst_tokens / self.burst_wall_s, 1)
            if self.burst_wall_s
            else 0.0,
            "burst_tokens_per_s_rounds": self.burst_tok_s_rounds,
            "burst_ttft_p50_ms": pct(self.burst_ttfts_ms, 50),
            "burst_ttft_p99_ms": pct(self.burst_ttfts_ms, 99),
            "poisson_tokens_per_s": round(self.poisson_tokens / self.poisson_wall_s, 1)
            if self.poisson_wall_s
            else 0.0,
            "poisson_ttft_p50_ms": pct(self.poisson_ttfts_ms, 50),
            "poisson_ttft_p99_ms": pct(self.poisson_ttfts_ms, 99),
            "failed": self.failed,
            "requests": self.requests,
            "cpu_ms_per_request": round(self.cpu_s * 1e3 / self.requests, 1)
            if self.requests
            else 0.0,
        }


def _take(results: list[Result], figures: ArmFigures) -> tuple[list[float], int]:
    ok = [r for r in results if r.ok]
    figures.failed += len(results) - len(ok)
    figures.requests += len(results)
    return [r.ttft_ms for r in ok if r.ttft_ms is not None], sum(r.tokens for r in ok)


async def burst_phase(client: httpx.AsyncClient, requests: list[dict[str, Any]],
                      figures: ArmFigures) -> None:  # fmt: skip
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(client, b, ENDPOINT) for b in requests))
    wall_s = time.perf_counter() - start
    ttfts, tokens = _take(list(results), figures)
    figures.burst_ttfts_ms += ttfts
    figures.burst_tokens += tokens
    figures.burst_wall_s += wall_s
    figures.burst_tok_s_rounds.append(round(tokens / wall_s, 1))


async def poisson_phase(client: httpx.AsyncClient, requests: list[dict[str, Any]],
                        offsets: list[float], figures: ArmFigures) -> None:  # fmt: skip
    start = time.perf_counter()

    async def one(offset: float, body: dict[str, Any]) -> Result:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await stream_one(client, body, ENDPOINT)

    results = await asyncio.gather(*(one(o, b) for o, b in zip(offsets, requests, strict=True)))
    ttfts, tokens = _take(list(results), figures)
    figures.poisson_ttfts_ms += ttfts
    figures.poisson_tokens += tokens
    figures.poisson_wall_s += time.perf_counter() - start


async def _run_async(started: dict[str, Server], plan: Plan, vocab: int) -> dict[str, Any]:
    figures = {arm: ArmFigures() for arm in ARMS}
    clients = {
        arm: httpx.AsyncClient(
            base_url=server.base_url,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=600.0,
            limits=httpx.Limits(max_connections=plan.burst + 64),
        )
        for arm, server in started.items()
    }
    try:
        for arm in ARMS:  # warm-up: first requests pay for lazy setup on both
            await burst_phase(clients[arm], bodies(8, 32, 16, vocab, seed=99), ArmFigures())
            await asyncio.sleep(PAUSE_S)
        for rnd in range(plan.rounds):
            order = ARMS if rnd % 2 == 0 else tuple(reversed(ARMS))
            burst = bodies(plan.burst, plan.max_prompt, plan.max_output, vocab, seed=rnd)
            offsets = arrivals(100_000, plan.rate, plan.poisson_s, seed=1000 + rnd)
            light = bodies(len(offsets), plan.max_prompt, plan.max_output, vocab,
                           seed=1000 + rnd, fixed_output=plan.poisson_output)  # fmt: skip
            for arm in order:
                own, kids = cpu_seconds(started[arm].proc.pid)
                await burst_phase(clients[arm], burst, figures[arm])
                await asyncio.sleep(PAUSE_S)
                await poisson_phase(clients[arm], light, offsets, figures[arm])
                await asyncio.sleep(PAUSE_S)
                own2, kids2 = cpu_seconds(started[arm].proc.pid)
                figures[arm].cpu_s += own2 + kids2 - own - kids
    finally:
        for client in clients.values():
            await client.aclose()
    return {arm: f.summary() for arm, f in figures.items()}


def _versions() -> dict[str, str]:
    out = subprocess.run([str(PEER_PYTHON), "-c", "import importlib.metadata as m;"
                          "print(m.version('vllm-cpu'), m.version('torch'))"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    vllm, _, torch = out.stdout.strip().partition(" ")
    return {"vllm_cpu": vllm, "vllm_torch": torch}


def run(quick: bool = False, data_dir: str | None = None,
        peer: PeerSettings | None = None) -> dict[str, Any]:  # fmt: skip
    plan = PLANS["quick" if quick else "full"]
    peer = peer or PeerSettings()
    result: dict[str, Any] = {"plan": asdict(plan), "peer_settings": asdict(peer)}
    if not PEER_PYTHON.exists():
        result["skipped"] = {"vllm": INSTALL_HINT}
        return result
    from benchmarks.engine import BENCH_MODEL
    from sluice.engine.loader import resolve_model_dir
    from sluice.settings import CommonSettings, load_settings

    data_dir = data_dir or str(load_settings(CommonSettings).data_dir)
    src = resolve_model_dir(MODEL, data_dir, BENCH_MODEL)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    result["versions"] = _versions()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-vllm-") as tmp:
        workdir = Path(tmp)
        model_dir = full_vocab_dir(src, workdir / "model")
        with servers(launches(model_dir, workdir, peer), workdir, timeout_s=600) as started:
            arms = asyncio.run(_run_async(started, plan, vocab))
            result["commands"] = {arm: s.proc.args for arm, s in started.items()}
    result["arms"] = arms
    s, v = arms["sluice"], arms["vllm"]
    result["ratios"] = {
        "burst_tokens_per_s": ratio(s["burst_tokens_per_s"], v["burst_tokens_per_s"]),
        "burst_ttft_p99": ratio(s["burst_ttft_p99_ms"], v["burst_ttft_p99_ms"]),
        "poisson_tokens_per_s": ratio(s["poisson_tokens_per_s"], v["poisson_tokens_per_s"]),
        "poisson_ttft_p99": ratio(s["poisson_ttft_p99_ms"], v["poisson_ttft_p99_ms"]),
    }
    r = result["ratios"]
    result["checks"] = {
        "burst_tokens_per_s_vs_vllm": {"value": r["burst_tokens_per_s"],
                                       "min": TARGETS["burst_tokens_per_s_vs_vllm_min"]},
        "burst_ttft_p99_vs_vllm": {"value": r["burst_ttft_p99"],
                                   "max": TARGETS["burst_ttft_p99_vs_vllm_max"]},
    }  # fmt: skip
    return result


def render(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"vLLM arm skipped: {result['skipped']['vllm']}"
    lines = [f"sluice serve vs vLLM CPU {result['versions']['vllm_cpu']} "
             f"({result['peer_settings']})",
             "| arm | burst tok/s | burst TTFT p50 / p99 ms | Poisson tok/s | "
             "Poisson TTFT p50 / p99 ms | failed | CPU ms/request |", "|" + "---|" * 7]  # fmt: skip
    for arm, a in result["arms"].items():
        lines.append(
            f"| {arm} | {a['burst_tokens_per_s']} | {a['burst_ttft_p50_ms']} / "
            f"{a['burst_ttft_p99_ms']} | {a['poisson_tokens_per_s']} | "
            f"{a['poisson_ttft_p50_ms']} / {a['poisson_ttft_p99_ms']} | {a['failed']} | "
            f"{a['cpu_ms_per_request']} |"
        )
    lines.append(f"sluice / vLLM: {result['ratios']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND")
    args = ap.parse_args(argv)
    result = run(args.quick, peer=PeerSettings(threads_bind=args.threads_bind))
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
