"""Peer systems for `benchmarks.engine`: HF `generate` (static batches), transformers continuous
batching, and llama.cpp (only when `llama-cpp-python` is importable and a GGUF is given).

Each function runs one workload on the same weights and returns `{"tokens_per_s", "ttft_ms"}`
(fields a workload does not measure are left out). transformers is imported lazily here,
never by `engine/`.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def load_hf(path: Path, dtype: torch.dtype) -> Any:
    """`path`: a model directory, or a .gguf file (transformers de-quantizes it)."""
    from transformers import AutoModelForCausalLM

    where = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        path.parent if where else path, dtype=dtype, attn_implementation="sdpa", **where
    )
    model.generation_config.eos_token_id = None  # random weights: lengths must be exact
    model.generation_config.pad_token_id = 0
    return model.eval()


def export_hf(gguf: Path, dest: Path, dtype: torch.dtype) -> Path:
    """The GGUF as a Hugging Face directory (weights de-quantized into `dtype` by
    transformers, its tokenizer and chat template) for peers that read no GGUF, such as
    vLLM here; written once per file and dtype under `dest`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = dest / f"{gguf.stem}-{str(dtype).removeprefix('torch.')}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    # the weights are plain tensors once loaded: save them as such, not as "gguf-quantized"
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out


def hf_static(model: Any, prompts: list[list[int]], outputs: list[int], batch: int = 32) -> dict:
    """Left-padded static batches of `batch`; each batch runs to its longest output."""
    useful = sum(outputs)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i : i + batch], outputs[i : i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(os_)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
    dt = time.perf_counter() - t0
    return {"tokens_per_s": useful / dt}


def hf_batch1(model: Any, prompt: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t0
    return {"tokens_per_s": (new_tokens - 1) / max(total - ttft, 1e-9), "ttft_ms": ttft * 1e3}


def hf_ttft(model: Any, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    return (time.perf_counter() - t0) * 1e3


def hf_continuous_batching(model: Any, prompts: list[list[int]], outputs: list[int]) -> dict:
    """transformers CB with per-request max_new_tokens; the KV cache is sized explicitly
    (unset, transformers sizes it from ~90 % of RAM on CPU)."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1)
    cb = ContinuousBatchingConfig(
        page_size=256,
        num_blocks=128,
        max_batch_tokens=512,
        use_cuda_graph=False,
        auto_switch_to_flash=False,
    )
    got = 0
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=600
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=o) for p, o in zip(prompts, outputs, strict=True)
        ]
        for _ in ids:
            res = manager.get_result(timeout=600)
            if res is None:
                break
            got += len(res.generated_tokens)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": got / dt, "generated_tokens": got}


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_batch1(gguf: Path) -> Callable[[list[int], int], dict]:
    """Load `gguf` once (2 threads, as every system here); the returned function runs one
    greedy batch-1 generation: tokens/s after the first token, and TTFT."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=2, n_batch=512, verbose=False)

    def run(prompt: list[int], new_tokens: int) -> dict:
        llm.reset()
        t0 = time.perf_counter()
        ttft = None
        n = 0
        for _tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            n += 1
            if n >= new_tokens:
                break
        total = time.perf_counter() - t0
        assert ttft is not None
        return {"tokens_per_s": (n - 1) / max(total - ttft, 1e-9), "ttft_ms": ttft * 1e3}

    return run


def llama_cpp_mixed(
    gguf: Path, max_num_seqs: int, max_num_batched_tokens: int
) -> Callable[[list[list[int]], list[int]], dict]:
    """llama.cpp's batched decode on `gguf`, scheduled as its server schedules: up to
    `max_num_seqs` sequences in one KV cache, each step one token per running sequence plus
    the prompts of new ones while the step's token budget lasts, greedy, outputs to their
    exact lengths. Returns a function that runs one workload: tokens/s and mean TTFT."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = max_num_seqs * 512
    cparams.n_batch = max_num_batched_tokens
    cparams.n_seq_max = max_num_seqs
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.kv_unified = False  # a KV stream per sequence: attention reads its own only
    ctx = lc.llama_init_from_model(model, cparams)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(max_num_batched_tokens, 0, 1)

    def run(prompts: list[list[int]], outputs: list[int]) -> dict:
        lc.llama_memory_clear(memory, True)
        waiting = list(range(len(prompts)))
        free_seqs = list(range(max_num_seqs))
        running: dict[int, dict] = {}  # request -> seq, position, last token, tokens out
        first: list[float] = []
        generated = 0
        t0 = time.perf_counter()
        while waiting or running:
            n = 0
            rows: list[tuple[int, int]] = []  # (batch index of a logits row, its request)

            def add(token: int, pos: int, seq: int, want: bool) -> None:
                nonlocal n
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = seq, want
                n += 1

            for r, s in running.items():
                rows.append((n, r))
                add(s["last"], s["pos"], s["seq"], True)
            while waiting and free_seqs and n + len(prompts[waiting[0]]) <= max_num_batched_tokens:
                r = waiting.pop(0)
                seq = free_seqs.pop()
                for i, token in enumerate(prompts[r]):
                    add(token, i, seq, i == len(prompts[r]) - 1)
                running[r] = {"seq": seq, "pos": len(prompts[r]), "out": 0, "new": True}
                rows.append((n - 1, r))
            batch.n_tokens = n
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, r in rows:
                ptr = ctypes.cast(lc.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float))
                logits = np.ctypeslib.as_array(ptr, (vocab,))
                s = running[r]
                if s.pop("new", False):
                    first.append(time.perf_counter() - t0)
                else:
                    s["pos"] += 1
                s["last"] = int(logits.argmax())
                s["out"] += 1
                generated += 1
                if s["out"] >= outputs[r]:
                    lc.llama_memory_seq_rm(memory, s["seq"], -1, -1)
                    free_seqs.append(s["seq"])
                    del running[r]
        elapsed = time.perf_counter() - t0
        return {
            "tokens_per_s": generated / elapsed,
            "ttft_ms": 1e3 * sum(first) / len(first),
            "elapsed_s": elapsed,
        }

    return run
