"""LoRA benchmark: one engine serving four adapters at once vs the base model and merged copies.

`sluice bench engine`'s mixed workload (64 requests, prompt U[16,128], output U[16,256],
EOS ignored, greedy), each request given one of four random PEFT adapters (rank 16 on
all seven projections, A and B drawn: PEFT's zero B would change nothing) in turn, on
one engine with `max_loras=4` (the adapters resident, every step mixing them), beside:
- base: the same workload on the base model alone, no adapter (goal: LoRA >= 0.8x its
  output tokens/s);
- merged: four engines, each with one adapter merged into its weights
  (`merge_and_unload`), serving their quarter of the workload in turn (time-sliced: one
  engine's batch at a time, as a host with room for one model's working set would).
Reps interleave the three arms; figures are medians, ratios per rep then the median.
Each arm's CPU time (this process, every thread) is taken too, with the ratio of tokens
per CPU second: on a host shared with other work, wall time measures the neighbours.
Also timed: loading one adapter into a slot (read + copy, the cost of a miss).
The default model is `sluice bench engine`'s (the tiny-llama preset at hidden 512, 8
layers, random seeded weights); the adapters are made by peft beside it.

`python -m benchmarks.lora [--quick] [--model DIR] [--dtype bfloat16|float32] [--json]`
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine import BENCH_MODEL, SLUICE_CONFIG, bench_workloads, engine_options
from benchmarks.stats import run_figures
from sluice.engine.backends.base import EngineRequest, LoRARequest
from sluice.engine.backends.torch_backend import apply_process_options
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore
from sluice.engine.loader import LoadedModel, load_model, resolve_model_dir
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams

NUM_ADAPTERS = 4
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_adapters(model_dir: Path, root: Path) -> list[Path]:
    """Four seeded random adapters for `model_dir` (made once under `root`)."""
    import peft
    import transformers

    paths = [root / f"lora-r{RANK}-{i}" for i in range(NUM_ADAPTERS)]
    if all((p / "adapter_config.json").is_file() for p in paths):
        return paths
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS)
    model = peft.get_peft_model(base, config)
    for i, path in enumerate(paths):
        generator = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        model.save_pretrained(path)
    return paths


def merged_model(model_dir: Path, adapter: Path, root: Path) -> Path:
    """The base with `adapter` merged into its weights, as a model directory."""
    import peft
    import transformers

    out = root / f"{adapter.name}-merged"
    if (out / "config.json").is_file():
        return out
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


class Engine:
    """One EngineCore over a loaded model, run to completion per workload."""

    def __init__(self, lm: LoadedModel, dtype: str) -> None:
        self.config = EngineConfig(
            dtype=dtype, block_size=16, kv_cache_mb=256, max_loras=NUM_ADAPTERS, **SLUICE_CONFIG
        )
        self.runner = ModelRunner(lm.model, self.config, engine_options())
        self.core = EngineCore(self.config, self.runner, eos_token_ids=lm.eos_token_ids)
        self.tags = 0

    def run(
        self,
        prompts: list[list[int]],
        outputs: list[int],
        loras: list[LoRARequest | None] | None = None,
    ) -> dict:
        self.core.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
        self.tags += 1
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            lora = loras[i] if loras else None
            self.core.add_request(
                EngineRequest(f"{self.tags}-{i}", prompt, params, lora_request=lora)
            )
        first: dict[str, float] = {}
        generated = 0
        cpu0 = time.process_time()
        while self.core.has_unfinished():
            for d in self.core.step():
                if d.error:
                    raise RuntimeError(f"request {d.request_id} failed: {d.error}")
                if d.token_ids:
                    generated += len(d.token_ids)
                    first.setdefault(d.request_id, time.perf_counter() - t0)
        figures = run_figures(generated, time.perf_counter() - t0, first.values())
        figures["cpu_s"] = time.process_time() - cpu0
        return figures


def _time_slices(engines: list[Engine], prompts: list[list[int]], outputs: list[int]) -> dict:
    """Each merged engine serves its quarter (requests i % 4 == k) in turn."""
    generated, elapsed, cpu_s, ttfts = 0, 0.0, 0.0, []
    for k, engine in enumerate(engines):
        part = range(k, len(prompts), len(engines))
        r = engine.run([prompts[i] for i in part], [outputs[i] for i in part])
        # a request's wait for its engine's turn counts in its TTFT
        ttfts.append(r["ttft_ms"] / 1e3 + elapsed)
        generated += r["generated_tokens"]
        elapsed += r["elapsed_s"]
        cpu_s += r["cpu_s"]
    figures = run_figures(generated, elapsed, ttfts)
    figures["cpu_s"] = cpu_s
    figures["ttft_ms"] = round(figures["ttft_ms"], 1)
    return figures


def _load_ms(engine: Engine, loras: list[LoRARequest], prompt: list[int]) -> float:
    """The slowest of loading each adapter once (a one-token request each, alone)."""
    times = []
    for lora in loras:
        engine.core.add_request(
            EngineRequest(
                f"load-{lora.name}", prompt, SamplingParams(max_tokens=1), lora_request=lora
            )
        )
        t0 = time.perf_counter()
        while engine.core.has_unfinished():
            engine.core.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(max(times), 2)


def run(
    quick: bool = False,
    model: str | None = None,
    dtype: str = "bfloat16",
    data_dir: str | None = None,
    reps: int | None = None,
) -> dict:
    """`reps`: interleaved reps of the three arms (default 3, 1 with `quick`)."""
    apply_process_options(engine_options())  # this process is the benchmark's root
    torch.manual_seed(0)
    if model is None:
        from sluice.settings import CommonSettings, load_settings

        data = Path(data_dir or load_settings(CommonSettings).data_dir)
        model_dir = resolve_model_dir("tiny-llama", data, BENCH_MODEL)
    else:
        model_dir = Path(model)
    root = model_dir.parent / f"{model_dir.name}-lora"
    root.mkdir(exist_ok=True)
    adapter_dirs = make_adapters(model_dir, root)
    loras = [LoRARequest(p.name, str(p)) for p in adapter_dirs]
    lm = load_model(model_dir, dtype=dtype)
    vocab = lm.model.config.vocab_size
    work = bench_workloads(quick, vocab)["mixed"]
    prompts, outputs = work.prompts, work.outputs
    assigned: list[LoRARequest | None] = [loras[i % NUM_ADAPTERS] for i in range(len(prompts))]

    base, lora = Engine(lm, dtype), Engine(load_model(model_dir, dtype=dtype), dtype)
    merged = [
        Engine(load_model(merged_model(model_dir, d, root), dtype=dtype), dtype)
        for d in adapter_dirs
    ]
    load_ms = _load_ms(lora, loras, prompts[0])  # also leaves the four resident
    warm = (prompts[:2], [4, 4])
    base.run(*warm)
    lora.run(*warm, [loras[0], loras[1]])
    for engine in merged:
        engine.run(*warm)

    runs: dict[str, list[dict]] = {"lora": [], "base": [], "merged": []}
    for _ in range(reps or (1 if quick else 3)):
        runs["lora"].append(lora.run(prompts, outputs, assigned))
        runs["base"].append(base.run(prompts, outputs))
        runs["merged"].append(_time_slices(merged, prompts, outputs))
    systems = {k: _median(v) for k, v in runs.items()}
    return {
        "benchmark": "lora",
        "model": str(model_dir) if model else "tiny-llama h512 L8 (bench engine preset)",
        "dtype": dtype,
        "adapters": {"count": NUM_ADAPTERS, "rank": RANK, "targets": TARGETS},
        "requests": len(prompts),
        "adapter_load_ms": load_ms,
        "systems": systems,
        "ratios": {
            "lora_vs_base": _ratio(runs["lora"], runs["base"]),
            "lora_vs_merged_time_sliced": _ratio(runs["lora"], runs["merged"]),
            "lora_vs_base_per_cpu_s": _ratio(runs["lora"], runs["base"], "tokens_per_cpu_s"),
            "lora_vs_merged_per_cpu_s": _ratio(runs["lora"], runs["merged"], "tokens_per_cpu_s"),
        },
        "per_rep": {
            "lora_vs_base": _per_rep(runs["lora"], runs["base"]),
            "lora_vs_merged_time_sliced": _per_rep(runs["lora"], runs["merged"]),
            "lora_vs_base_per_cpu_s": _per_rep(runs["lora"], runs["base"], "tokens_per_cpu_s"),
        },
        "goal": {"lora_vs_base": 0.8},
    }


def _median(reps: list[dict]) -> dict:
    return {
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in reps), 1),
        "tokens_per_cpu_s": round(statistics.median(_per_cpu_s(r) for r in reps), 1),
        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in reps), 1),
        "elapsed_s": round(statistics.median(r["elapsed_s"] for r in reps), 2),
    }


def _per_cpu_s(r: dict) -> float:
    return float(r["generated_tokens"] / max(r["cpu_s"], 1e-9))


def _per_rep(a: list[dict], b: list[dict], key: str = "tokens_per_s") -> list[float]:
    def value(r: dict) -> float:
        return _per_cpu_s(r) if key == "tokens_per_cpu_s" else float(r[key])

    return [round(value(x) / value(y), 3) for x, y in zip(a, b, strict=True)]


def _ratio(a: list[dict], b: list[dict], key: str = "tokens_per_s") -> float:
    return round(statistics.median(_per_rep(a, b, key)), 3)


def render(result: dict) -> str:
    lines = [
        f"Sluice LoRA benchmark  model={result['model']}  dtype={result['dtype']}  "
        f"{result['requests']} requests over {result['adapters']['count']} adapters "
        f"(rank {result['adapters']['rank']}, 7 projections)",
        f"{'system':<34}{'tokens/s':>10}{'tok/CPU s':>11}{'TTFT p50 ms':>13}{'elapsed s':>11}",
    ]
    names = {
        "lora": "4 adapters, one engine (batched)",
        "base": "base model alone",
        "merged": "4 merged engines, time-sliced",
    }
    for key, figures in result["systems"].items():
        lines.append(
            f"{names[key]:<34}{figures['tokens_per_s']:>10}{figures['tokens_per_cpu_s']:>11}"
            f"{figures['ttft_ms']:>13}"
            f"{figures['elapsed_s']:>11}"
        )
    ratios = result["ratios"]
    lines.append(
        f"lora vs base {ratios['lora_vs_base']}x (goal >= 0.8x); lora vs merged time-sliced "
        f"{ratios['lora_vs_merged_time_sliced']}x; per CPU second: vs base "
        f"{ratios['lora_vs_base_per_cpu_s']}x, vs merged {ratios['lora_vs_merged_per_cpu_s']}x; "
        f"adapter load (slowest) "
        f"{result['adapter_load_ms']} ms"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the smaller workload, one rep")
    ap.add_argument("--model", help="a Hugging Face model directory (default: bench preset)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--data-dir", help="where the preset model is created (default ~/.sluice)")
    ap.add_argument("--reps", type=int, help="interleaved reps (default 3; 1 with --quick)")
    args = ap.parse_args(argv)
    result = run(args.quick, args.model, args.dtype, args.data_dir, args.reps)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
