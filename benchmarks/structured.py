"""Structured-output benchmark: the cost of JSON-schema constraints in Sluice's engine.

(a) throughput: `sluice bench engine`'s mixed workload with every request under a schema
of `benchmarks/schemas.py` (cycling), beside the same prompts unconstrained, on one
engine in this process. A constrained request ends when its JSON is complete, so the
unconstrained run generates, per request, as many tokens as the constrained one did (EOS
ignored): the ratio of tokens/s then measures the masking alone (goal >= 0.95x). Each
constrained output is parsed and validated against its schema (goal: every one that
finished; one cut at max_tokens cannot be complete, and is counted apart).
(b) grammar compile time over the suite, p50/p99: cold (the compiler's first sight of
the schema) and cached (a hit in its cache), each up to the first token mask.
(c) `--vllm`: vLLM's CPU build (`scripts/peers vllm`) on the same prompts and schemas.

`python -m benchmarks.structured [--quick] [--model NAME|DIR|FILE.gguf] [--vllm] [--json]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.schemas import SCHEMAS, SchemaCase
from benchmarks.stats import percentile

DEFAULT_MODEL = "smollm2-135m-instruct"
# every constrained request's max_tokens: room for any instance of the suite, so an output
# that does not validate is the engine's fault, not the budget's (the mixed workload's own
# output lengths, U[16, 256], would cut the larger schemas short)
CONSTRAINED_MAX_TOKENS = 512


def latency_summary(values_ms: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of some milliseconds (nearest rank), rounded for the table."""
    return {
        "p50_ms": round(percentile(values_ms, 50), 3),
        "p99_ms": round(percentile(values_ms, 99), 3),
        "max_ms": round(max(values_ms), 3) if values_ms else float("nan"),
    }


def check_output(text: str, schema: dict[str, Any]) -> str | None:
    """None when `text` is JSON that `schema` accepts, else why not (one line)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg}"
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"invalid: {error.message[:120]}"


def validity(
    texts: Sequence[str], finishes: Sequence[str | None], cases: Sequence[SchemaCase]
) -> dict[str, Any]:
    """How many constrained outputs parse and validate, of all and of those that ended on
    their own (one cut at max_tokens is incomplete JSON by construction)."""
    valid = cut = valid_finished = 0
    failures: list[dict[str, str]] = []
    for text, finish, case in zip(texts, finishes, cases, strict=True):
        why = check_output(text, case.schema)
        valid += why is None
        if finish == "length":
            cut += 1
            continue
        valid_finished += why is None
        if why is not None and len(failures) < 5:
            failures.append({"schema": case.name, "why": why, "text": text[:120]})
    total, finished = len(texts), len(texts) - cut
    return {
        "outputs": total,
        "valid": valid,
        "valid_fraction": round(valid / total, 4) if total else None,
        "cut_at_max_tokens": cut,
        "valid_fraction_of_finished": round(valid_finished / finished, 4) if finished else None,
        "failures": failures,  # the first few that finished invalid
    }


def cycle_cases(n: int) -> list[SchemaCase]:
    """The suite's schemas, one per request, cycling."""
    return [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]


# -- (a) throughput and validity ----------------------------------------------------------


def _bench_throughput(run: Any, prompts: list[list[int]], outputs: list[int], reps: int) -> dict:
    from benchmarks.engine import _interleave, _median_of, rep_ratios
    from sluice.engine.sampling import Constraint, SamplingParams

    cases = cycle_cases(len(prompts))
    constrained = [
        SamplingParams(
            temperature=0.0,
            max_tokens=CONSTRAINED_MAX_TOKENS,
            constraint=Constraint("json_schema", json.dumps(case.schema)),
        )
        for o, case in zip(outputs, cases, strict=True)
    ]
    pool = run.core.scheduler.kv_cache_manager.block_pool
    texts: dict[str, list[str]] = {}
    finishes: dict[str, str | None] = {}
    lengths: dict[str, int] = {}

    def record(d: Any) -> None:
        texts.setdefault(d.request_id, []).append(d.text)
        lengths[d.request_id] = lengths.get(d.request_id, 0) + len(d.token_ids)
        if d.finish_reason is not None:
            finishes[d.request_id] = d.finish_reason

    run.run(prompts[:2], [4, 4], "warm", params=constrained[:2])
    pool.reset_prefix_cache()
    run.run(prompts, outputs, "c-first-", params=constrained, on_delta=record)
    ids = [f"c-first-{i}" for i in range(len(prompts))]
    matched = [max(1, lengths.get(rid, 0)) for rid in ids]  # what each constrained one made
    tags = iter(range(10**6))

    def unconstrained() -> dict:
        pool.reset_prefix_cache()
        return run.run(prompts, matched, f"u{next(tags)}-")

    def constrained_rep() -> dict:
        pool.reset_prefix_cache()
        return run.run(prompts, outputs, f"c{next(tags)}-", params=constrained)

    runs = _interleave({"unconstrained": unconstrained, "constrained": constrained_rep}, reps)
    per_rep = rep_ratios(runs["constrained"], runs["unconstrained"])
    systems = {name: _median_of(r) for name, r in runs.items()}
    for s in systems.values():
        s.pop("elapsed_s", None)
    return {
        "systems": systems,
        "ratio_constrained_vs_unconstrained": round(statistics.median(per_rep), 3)
        if per_rep
        else None,
        "per_rep": per_rep,
        "reps": reps,
        "requests": len(prompts),
        "lengths": matched,
        "validity": validity(
            ["".join(texts.get(rid, [])) for rid in ids], [finishes.get(rid) for rid in ids], cases
        ),
    }


# -- (b) compile time ----------------------------------------------------------------------


def _bench_compile(tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> dict:
    """Each schema's compile to its first token mask, through the engine's compiler
    (`engine.structured.GrammarCompiler`, its cache cold then hot)."""
    import numpy as np

    from sluice.engine.sampling import Constraint
    from sluice.engine.structured import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, list(eos))
    t0 = time.perf_counter()
    compiler.ll_tokenizer  # noqa: B018 - built once per engine, not per grammar
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    row = np.zeros(compiler.mask_words, dtype=np.int32)
    constraints = [Constraint("json_schema", json.dumps(c.schema)) for c in SCHEMAS]

    def one(constraint: Constraint) -> float:
        t = time.perf_counter()
        compiler.matcher(constraint).fill_mask(row)
        return (time.perf_counter() - t) * 1e3

    cold = [one(c) for c in constraints]
    cached = [one(c) for c in constraints]
    return {
        "schemas": len(constraints),
        "tokenizer_setup_ms": round(tokenizer_ms, 1),
        "cold": latency_summary(cold),
        "cached": latency_summary(cached),
        "slowest_cold": SCHEMAS[max(range(len(cold)), key=cold.__getitem__)].name,
    }


# -- (c) vLLM ------------------------------------------------------------------------------


def _bench_vllm(
    model: str, dtype: str, prompts: list[list[int]], outputs: list[int], lengths: list[int]
) -> dict:
    """vLLM's CPU build in its own virtualenv: the same prompts, constrained (its
    `structured_outputs`; validity at `outputs` tokens), then constrained to `lengths`
    (Sluice's outputs' lengths: the same work, for tokens/s), then unconstrained to its
    own outputs' lengths, as Sluice's runs."""
    from benchmarks import vllm_peer

    if not vllm_peer.available():
        return {"skipped": f"vLLM's CPU build is not installed ({vllm_peer.INSTALL_HINT})"}
    job = {
        "model": model,
        "dtype": dtype,
        "prompts": prompts,
        "outputs": outputs,
        "lengths": lengths,
        "schemas": [json.dumps(c.schema) for c in cycle_cases(len(prompts))],
    }
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": vllm_peer.threads_bind(2),
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
    )
    proc = subprocess.run(
        [str(vllm_peer.PEER_PYTHON), "-m", "benchmarks.structured", "--vllm-runner"],
        cwd=vllm_peer.ROOT,
        env=env,
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        return {"error": f"vLLM runner exited {proc.returncode}: {proc.stderr[-2000:]}"}
    result: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = cycle_cases(len(prompts))
    result["validity"] = validity(result.pop("texts"), result.pop("finishes"), cases)
    return result


def _vllm_runner() -> None:
    """Under the vLLM venv's python: one job from stdin, one JSON line out."""
    from benchmarks.stats import run_figures
    from benchmarks.vllm_peer import protocol_stdout

    out = protocol_stdout()
    job = json.loads(sys.stdin.read())
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=64, max_model_len=4096, seed=0)
    engine = llm.llm_engine
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def generate(params: list[Any], tag: str) -> tuple[dict, list[Any]]:
        llm.reset_prefix_cache()
        t0, first, done = time.perf_counter(), {}, {}
        for i, (p, sp) in enumerate(zip(prompts[: len(params)], params, strict=True)):
            engine.add_request(f"{tag}{i}", p, sp)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.outputs and o.outputs[0].token_ids:
                    first.setdefault(o.request_id, time.perf_counter() - t0)
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        finals = [done[f"{tag}{i}"] for i in range(len(params))]
        generated = sum(len(f.token_ids) for f in finals)
        return run_figures(generated, time.perf_counter() - t0, first.values()), finals

    constrained = [
        SamplingParams(
            temperature=0.0,
            max_tokens=n,
            # compact JSON, as Sluice's (free whitespace lets a weak model loop in blanks)
            structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True),
        )
        for n, s in zip(job["outputs"], job["schemas"], strict=True)
    ]
    generate(constrained[:2], "w")
    con, finals = generate(constrained, "c")
    same_work = [
        SamplingParams(
            temperature=0.0,
            max_tokens=n,
            structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True),
        )
        for n, s in zip(job["lengths"], job["schemas"], strict=True)
    ]
    matched_con, _ = generate(same_work, "m")
    matched = [max(1, len(f.token_ids)) for f in finals]
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in matched]
    unc, _ = generate(plain, "u")
    result = {
        "version": vllm.__version__,
        "systems": {
            "constrained": con,
            "constrained_to_sluice_lengths": matched_con,
            "unconstrained": unc,
        },
        "ratio_constrained_vs_unconstrained": round(con["tokens_per_s"] / unc["tokens_per_s"], 3),
        "texts": [f.text for f in finals],
        "finishes": [f.finish_reason for f in finals],
    }
    out.write(json.dumps(result) + "\n")
    out.flush()


# -- the run -------------------------------------------------------------------------------


def run(
    quick: bool = False,
    model: str | None = None,
    dtype: str = "bfloat16",
    data_dir: str | None = None,
    vllm: bool = False,
    requests: int | None = None,
) -> dict:
    """`requests`: fewer requests than the mixed workload's (a smoke run)."""
    import torch

    from benchmarks.engine import SluiceRun, apply_process_options, bench_workloads, engine_options
    from sluice.engine.loader import load_model, resolve_model_dir
    from sluice.engine.runner.model_runner import torch_dtype
    from sluice.engine.structured import GrammarCompiler

    apply_process_options(engine_options())
    torch.manual_seed(0)
    if data_dir is None:
        from sluice.settings import CommonSettings, load_settings

        data_dir = str(load_settings(CommonSettings).data_dir)
    path = resolve_model_dir(model or DEFAULT_MODEL, data_dir)
    lm = load_model(path, dtype=dtype)
    work = bench_workloads(quick, lm.config.vocab_size)["mixed"]
    prompts, outputs = work.prompts[:requests], work.outputs[:requests]
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "model": str(path),
        "dtype": dtype,
        "quick": quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_before": round(os.getloadavg()[0], 2),
        "compile": _bench_compile(lm.tokenizer, lm.config.vocab_size, lm.eos_token_ids),
    }
    engine = SluiceRun(lm, dtype)
    # the torch backend's runner gets the engine's grammar compiler so: the same here
    engine.runner.grammars = GrammarCompiler(lm.tokenizer, lm.config.vocab_size, lm.eos_token_ids)
    result["mixed"] = _bench_throughput(engine, prompts, outputs, 1 if quick else 3)
    if vllm:
        if path.suffix == ".gguf":  # vLLM on the same weights as a Hugging Face directory
            from pathlib import Path

            from benchmarks.engine_peers import export_hf

            path = export_hf(path, Path(".peers/exports"), torch_dtype(dtype))
        budgets = [CONSTRAINED_MAX_TOKENS] * len(prompts)
        lengths = result["mixed"]["lengths"]
        result["vllm"] = peer = _bench_vllm(str(path), dtype, prompts, budgets, lengths)
        if "systems" in peer:
            # the same work: vLLM constrained to the lengths Sluice's outputs had
            ours = result["mixed"]["systems"]["constrained"]["tokens_per_s"]
            theirs = peer["systems"]["constrained_to_sluice_lengths"]["tokens_per_s"]
            result["sluice_vs_vllm_constrained"] = round(ours / theirs, 2)
    result["load_avg_after"] = round(os.getloadavg()[0], 2)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return result


def render(result: dict) -> str:
    mixed, comp = result["mixed"], result["compile"]
    lines = [
        f"Sluice structured-output benchmark  model={result.get('model')}"
        f"  dtype={result.get('dtype')}  quick={result.get('quick')}"
        f"  threads={result.get('threads')}"
        f"  load_avg={result.get('load_avg_before')}->{result.get('load_avg_after')}",
        f"{'system':<28}{'tokens/s':>12}{'TTFT ms':>12}{'tokens':>10}",
    ]
    rows = [(f"sluice {k}", v) for k, v in mixed["systems"].items()]
    vllm = result.get("vllm") or {}
    rows += [(f"vllm {k}", v) for k, v in vllm.get("systems", {}).items()]
    for name, s in rows:
        lines.append(
            f"{name:<28}{s['tokens_per_s']:>12.1f}{s['ttft_ms']:>12.1f}{s['generated_tokens']:>10}"
        )
    lines.append(
        f"ratio constrained / unconstrained: sluice {mixed['ratio_constrained_vs_unconstrained']}x"
        f" (goal >= 0.95x, {mixed['requests']} requests, {mixed['reps']} reps)"
        + (f", vllm {vllm['ratio_constrained_vs_unconstrained']}x" if "systems" in vllm else "")
    )
    if "sluice_vs_vllm_constrained" in result:
        lines.append(
            f"sluice / vllm, constrained tokens/s at Sluice's output lengths:"
            f" {result['sluice_vs_vllm_constrained']}x (goal >= 1.2x)"
        )
    for name, v in (("sluice", mixed["validity"]), ("vllm", vllm.get("validity"))):
        if v:
            lines.append(
                f"valid JSON ({name}): {v['valid']}/{v['outputs']} = {v['valid_fraction']}"
                f"; of those that finished: {v['valid_fraction_of_finished']}"
                f" (goal 1.0); cut at max_tokens: {v['cut_at_max_tokens']}"
            )
            for f in v["failures"]:
                lines.append(f"  {f['schema']}: {f['why']}  {f['text']!r}")
    lines.append(
        f"grammar compile to first mask over {comp['schemas']} schemas"
        f" (tokenizer setup {comp['tokenizer_setup_ms']} ms, once):"
    )
    for kind in ("cold", "cached"):
        c = comp[kind]
        lines.append(
            f"  {kind:<7} p50 {c['p50_ms']} ms  p99 {c['p99_ms']} ms  max {c['max_ms']} ms"
        )
    lines.append(f"  slowest cold: {comp['slowest_cold']}")
    for key in ("skipped", "error"):
        if key in vllm:
            lines.append(f"vllm {key}: {vllm[key]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the smaller mixed workload, one rep")
    ap.add_argument("--model", help=f"preset, model directory or .gguf (default {DEFAULT_MODEL})")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--requests", type=int, help="only the first N requests (a smoke run)")
    ap.add_argument("--data-dir", help="where a preset model is created (default ~/.sluice)")
    ap.add_argument("--vllm", action="store_true", help="add vLLM (after: scripts/peers vllm)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--vllm-runner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_runner:
        _vllm_runner()
        return 0
    result = run(args.quick, args.model, args.dtype, args.data_dir, args.vllm, args.requests)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
