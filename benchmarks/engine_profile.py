"""Where a batch-1 decode step's time goes in Sluice's engine, beside the memory it streams.

Times each part of `EngineCore.step` over a greedy batch-1 decode (wrapping the runner's
calls, no change to the engine): input preparation, the decoder layers, the final norm and
lm_head, the argmax, and the rest of the step (scheduler, detokenizer, outputs). Each
part's weight bytes over its time gives the bandwidth it reaches, beside a plain copy's on
this host, since a batch-1 step reads every weight once: a step that reaches the copy's
bandwidth can only get faster by reading fewer bytes. The same figures for llama.cpp on the
same file when llama-cpp-python is installed: its tokens/s and the bytes its tensors hold.

`python -m benchmarks.engine_profile [--model FILE.gguf|DIR|preset] [--dtype bfloat16]
[--tokens 128] [--json]` (default: the default model, bf16 and int8)
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks import engine_peers as peers
from benchmarks.engine import SluiceRun, apply_process_options, engine_options
from sluice.engine.backends.base import EngineRequest
from sluice.engine.loader import LoadedModel, load_model, resolve_model_dir
from sluice.engine.runner import model_runner
from sluice.engine.sampling import SamplingParams

PROMPT_TOKENS = 64


def copy_bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    """GB/s of a tensor copy (bytes read + written) on the bench's threads: the ceiling a
    step that streams its weights can reach on this host."""
    src = torch.ones(mb << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return round(2 * src.numel() * 4 / best / 1e9, 1)


def _bytes(module: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every tensor a submodule holds (parameters,
    buffers, packed copies), a packed projection's two copies counted once (the bf16 one
    the decode kernels read, or the packed one)."""
    total = 0
    for m in module.modules():
        own = {
            id(t): t
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False), *vars(m).values())
            if isinstance(t, torch.Tensor)
        }
        small = getattr(m, "small_weight", None)
        if isinstance(small, torch.Tensor):
            own.pop(id(getattr(m, "packed", None)), None)
        total += sum(t.numel() * t.element_size() for t in own.values() if not t.is_mkldnn)
        packed = getattr(m, "packed", None)
        if isinstance(packed, torch.Tensor) and packed.is_mkldnn and small is None:
            total += m.in_features * m.out_features * packed.element_size()
    return total


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return timed


@contextmanager
def _timed(run: SluiceRun, timers: _Timers) -> Iterator[None]:
    model = run.runner.model
    saved = (model.forward, model.compute_logits, run.core.step)
    module_saved = (model_runner.prepare_inputs, model_runner.greedy_tokens)
    model.forward = timers.wrap("layers", model.forward)  # type: ignore[method-assign]
    model.compute_logits = timers.wrap("norm_lm_head", model.compute_logits)  # type: ignore[method-assign]
    run.core.step = timers.wrap("step", run.core.step)  # type: ignore[method-assign]
    model_runner.prepare_inputs = timers.wrap("prepare_inputs", model_runner.prepare_inputs)
    model_runner.greedy_tokens = timers.wrap("argmax", model_runner.greedy_tokens)
    try:
        yield
    finally:
        model.forward, model.compute_logits, run.core.step = saved  # type: ignore[method-assign]
        model_runner.prepare_inputs, model_runner.greedy_tokens = module_saved


def profile_sluice(lm: LoadedModel, dtype: str, tokens: int) -> dict[str, Any]:
    run = SluiceRun(lm, dtype)
    prompt = list(range(10, 10 + PROMPT_TOKENS))
    run.run([prompt], [8], "w")  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run.core.add_request(EngineRequest("p", prompt, params))
    while run.core.has_unfinished():  # the prefill, outside the figures
        run.core.step()
    timers = _Timers()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    run.core.add_request(EngineRequest("d", prompt, params))
    run.core.step()  # its prefill (a prefix-cache hit but the last block)
    with _timed(run, timers):
        steps = 0
        while run.core.has_unfinished():
            run.core.step()
            steps += 1
    s = timers.seconds
    per_step_ms = {k: round(v / steps * 1e3, 3) for k, v in s.items()}
    parts = ("prepare_inputs", "layers", "norm_lm_head", "argmax")
    per_step_ms["rest_of_step"] = round(per_step_ms["step"] - sum(per_step_ms[p] for p in parts), 3)
    model = run.runner.model
    layer_bytes = sum(_bytes(layer) for layer in model.layers)
    head_bytes = _bytes(model.lm_head)
    return {
        "tokens_per_s": round(steps / s["step"], 1),
        "per_step_ms": per_step_ms,
        "share_of_step": {
            k: round(v / per_step_ms["step"], 3) for k, v in per_step_ms.items() if k != "step"
        },
        "weight_mb": {"layers": round(layer_bytes / 1e6, 1), "lm_head": round(head_bytes / 1e6, 1)},
        "read_gbs": {
            "layers": round(layer_bytes / (s["layers"] / steps) / 1e9, 1),
            "lm_head": round(head_bytes / (s["norm_lm_head"] / steps) / 1e9, 1),
        },
    }


def profile_llama_cpp(gguf: Path, tokens: int) -> dict[str, Any]:
    from gguf import GGUFReader

    generate = peers.llama_cpp_batch1(gguf)
    prompt = list(range(10, 10 + PROMPT_TOKENS))
    generate(prompt, 8)
    result = generate(prompt, tokens)
    reader = GGUFReader(gguf)
    weight = sum(int(t.n_bytes) for t in reader.tensors)
    step_s = 1 / result["tokens_per_s"]
    return {
        "tokens_per_s": round(result["tokens_per_s"], 1),
        "per_step_ms": round(step_s * 1e3, 3),
        "weight_mb": round(weight / 1e6, 1),
        "read_gbs": round(weight / step_s / 1e9, 1),
    }


def run(model: str | None, dtype: str, tokens: int) -> dict[str, Any]:
    apply_process_options(engine_options())
    path = resolve_model_dir(model or "smollm2-135m-instruct", None)
    result: dict[str, Any] = {
        "model": str(path),
        "dtype": dtype,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "copy_gbs": copy_bandwidth_gbs(),
        "sluice": profile_sluice(load_model(path, dtype=dtype), dtype, tokens),
        "sluice_int8": profile_sluice(
            load_model(path, dtype=dtype, quantization="int8"), dtype, tokens
        ),
    }
    if path.suffix == ".gguf" and peers.llama_cpp_available():
        result["llama_cpp"] = profile_llama_cpp(path, tokens)
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        f"batch-1 decode profile  model={result['model']}  dtype={result['dtype']}"
        f"  threads={result['threads']}  cpu={result['cpu']}  copy={result['copy_gbs']} GB/s"
    ]
    for name in ("sluice", "sluice_int8"):
        r = result[name]
        lines.append(f"{name}: {r['tokens_per_s']} tok/s")
        for part, ms in r["per_step_ms"].items():
            share = r["share_of_step"].get(part)
            lines.append(f"  {part:<16}{ms:>9.3f} ms" + (f"  {share:>6.1%}" if share else ""))
        lines.append(f"  weights MB {r['weight_mb']}  read GB/s {r['read_gbs']}")
    if "llama_cpp" in result:
        r = result["llama_cpp"]
        lines.append(
            f"llama_cpp: {r['tokens_per_s']} tok/s  {r['per_step_ms']} ms/step"
            f"  weights {r['weight_mb']} MB  read {r['read_gbs']} GB/s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine_profile", description=__doc__)
    ap.add_argument("--model", help="a .gguf file, a model directory or a preset")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.model, args.dtype, args.tokens)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
