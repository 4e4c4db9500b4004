"""Native CPU kernels for decode steps, built on first use with the system C compiler.

`cpu_ops()` returns the `CpuOps` of `cpu_ops.c` (AVX2 + FMA), or None where they cannot
run (one warning, see `load_cpu_ops`) or when `EngineOptions.kernels` is off. Callers keep
their torch path then. The shared library is cached per source hash under
`EngineOptions.kernel_cache_dir` (default `~/.cache/sluice/kernels`), so a machine compiles it once
(about a second). The bf16 GEMV uses AVX512-BF16 where the CPU has it (a function-level
target, chosen at run time), and so does `attn_paged`, the decode attention of large and
mixed steps, which runs on torch's own OpenMP threads (`-fopenmp`: the process has one
libgomp). The int8 GEMV (int8 weights, x quantized to int16 per row) serves the decode
steps of int8 models; `q_linear` (a GGUF's 4- or 8-bit blocks of 32, x quantized to int8
per block, AVX512-VNNI where the CPU has it) every step of a model that keeps them
(`engine.block_quant`).

Why: a batch-1 decode step of the bench model is ~35 small torch ops per layer, each paying
microseconds of dispatch, around GEMVs that torch runs below memory speed for bf16 weights
without native bf16. Here each small op is one call, a step's layers are one call together
(`decode_layers`: the Python around ~10 calls a layer cost ~0.7 ms a token), and the GEMVs
stream their weights once for up to MAX_ROWS rows. In larger steps of a bf16 model the bf16
small ops (RMSNorm, RoPE, SiLU*up) and `attn_paged` replace several torch ops each and the
gather of every request's padded keys.

Modules: `build` compiles, caches and loads the library; `bindings` is `CpuOps`, whose
calls check every tensor (`checks`: dtype, device, layout, shape, once a call) while the C
code checks the ids inside them (block ids, slots, positions) against the cache's size;
`plan` describes a model's layers for `decode_layers` and its LoRA adapters for `lora_add`
(each row's delta by its slot, inside `decode_layers` too); `config` holds the process
options.
"""

from sluice.engine.kernels.bindings import MAX_ROWS, SMALL_OP_PARALLEL_MIN, CpuOps
from sluice.engine.kernels.build import cache_dir, configure, cpu_ops, library_path, load_cpu_ops
from sluice.engine.kernels.plan import (
    LORA_COLS,
    DecodePlan,
    LayerWeights,
    LoRAPlan,
    LoRAProj,
    LoRARows,
    ProjWeights,
)

__all__ = [
    "LORA_COLS",
    "MAX_ROWS",
    "SMALL_OP_PARALLEL_MIN",
    "CpuOps",
    "DecodePlan",
    "LayerWeights",
    "LoRAPlan",
    "LoRAProj",
    "LoRARows",
    "ProjWeights",
    "cache_dir",
    "configure",
    "cpu_ops",
    "library_path",
    "load_cpu_ops",
]
