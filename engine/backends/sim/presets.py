"""The sim engine's latency model: how long one continuous-batching step takes on a GPU.

A step's time is linear in what it holds, as a roofline with the terms that dominate
serving on one GPU:

    step_s = base + per_seq·seqs + per_token·tokens + per_kv_token·kv_read + per_pair·pairs

base: reading the weights once per step (and launch overhead); per_token: the GEMMs, per
scheduled token (prompt chunk or decode); per_kv_token: attention reading each running
request's KV once per step (decode is memory-bound); per_pair: prefill attention's
query·key pairs (compute-bound, quadratic in the prompt). Each preset's coefficients are
fitted (`engine.backends.sim.calibrate`) so that the max-load throughput this model gives
matches published figures for that GPU and model (cited beside them). It is a model of
that setup, not a measurement of it: no queueing inside the GPU, no CUDA graphs' batch
padding, no speculative decoding, one GPU (no tensor parallelism).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BLOCK_SIZE = 16  # tokens per KV block, as vLLM and TensorRT-LLM page the cache


@dataclass(frozen=True, slots=True)
class SimPreset:
    """One modelled GPU + model: latency coefficients and the engine's shape."""

    name: str
    base_ms: float  # per step: weights read once, kernel launches
    per_seq_us: float  # per running request in the step: sampling, bookkeeping
    per_token_us: float  # per scheduled token: the GEMMs
    per_kv_token_ns: float  # per token of KV each scheduled request reads
    per_pair_ps: float  # per query·key pair of a prompt chunk (prefill attention)
    num_kv_blocks: int  # KV capacity in blocks of BLOCK_SIZE tokens
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = BLOCK_SIZE
    # True: admit a request only once KV for its whole sequence (prompt + max_tokens) is
    # free, allocated at once, so nothing is ever preempted (TensorRT-LLM's default
    # GUARANTEED_NO_EVICT); False: allocate as tokens come and preempt when full (vLLM)
    reserve_max_tokens: bool = False
    # a floor on a non-empty step's time: paces every stream at no more than
    # 1000 / min_step_ms tokens/s whatever the batch (a GPU shared with other work, or a
    # larger model's pace), so that a load test can hold many streams at a rate a person
    # reads at without the sum of their tokens exceeding what the host can carry
    min_step_ms: float = 0.0

    def step_time_s(self, num_seqs: int, num_tokens: int, num_kv_tokens: int, pairs: int) -> float:
        """The modelled time of one step; 0 for an empty one."""
        if num_seqs == 0:
            return 0.0
        return max(
            self.min_step_ms * 1e-3, self._roofline_s(num_seqs, num_tokens, num_kv_tokens, pairs)
        )

    def _roofline_s(self, num_seqs: int, num_tokens: int, num_kv_tokens: int, pairs: int) -> float:
        return (
            self.base_ms * 1e-3
            + self.per_seq_us * 1e-6 * num_seqs
            + self.per_token_us * 1e-6 * num_tokens
            + self.per_kv_token_ns * 1e-9 * num_kv_tokens
            + self.per_pair_ps * 1e-12 * pairs
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def replace(self, **changes: object) -> SimPreset:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# TensorRT-LLM's published throughput table ("perf overview", trtllm-bench, PyTorch
# backend, requests at an infinite rate; metric: total output tokens/s, one GPU):
# https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html
# (source: github.com/NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md,
# commit 00f37686aa854010d68bcbd0f4ab000221541ca6, tables "Llama 3.1 8B" and "Llama 3.3 70B").
# (ISL, OSL) -> output tokens/s; `engine.backends.sim.calibrate` prints the model beside them.
PUBLISHED_TOKENS_PER_S: dict[str, dict[tuple[int, int], float]] = {
    # Llama 3.1 8B, H200 TP1 (FP8): nvidia/Llama-3.1-8B-Instruct-FP8
    "h200-llama3.1-8b-fp8": {
        (128, 128): 27_911,
        (128, 2048): 26_221,
        (128, 4096): 18_027,
        (500, 2000): 20_770,
        (1000, 1000): 17_744,
        (1000, 2000): 16_828,
        (2048, 128): 3_538,
        (2048, 2048): 12_194,
        (5000, 500): 3_902,
        (20000, 2000): 1_804,
    },
    # Llama 3.1 8B, H100 TP1 (FP8): same model, H100 SXM 80GB
    "h100-llama3.1-8b-fp8": {
        (128, 128): 28_312,
        (128, 2048): 22_714,
        (128, 4096): 14_325,
        (500, 2000): 17_660,
        (1000, 1000): 15_220,
        (1000, 2000): 13_899,
        (2048, 128): 3_450,
        (2048, 2048): 9_305,
        (5000, 500): 3_459,
        (20000, 2000): 1_351,
    },
    # Llama 3.3 70B, H200 TP1 (FP8): nvidia/Llama-3.3-70B-Instruct-FP8
    "h200-llama3.3-70b-fp8": {
        (128, 128): 3_803,
        (128, 2048): 4_336,
        (128, 4096): 2_872,
        (500, 2000): 3_666,
        (1000, 1000): 2_909,
        (1000, 2000): 2_994,
        (2048, 128): 442,
        (2048, 2048): 2_003,
        (5000, 500): 566,
        (20000, 2000): 283,
    },
}

# Coefficients: `python -m engine.backends.sim.calibrate --fit` (least squares on log
# throughput over every published ISL/OSL point of the preset), rounded; the fitted
# steady state is within 6% of each point. They agree with the hardware: on H200, 8B's
# 14.7 us/token is 16 GFLOP at ~1.1 PFLOP/s of FP8, its 14.2 ns per KV token is 64 KiB
# read at ~4.6 TB/s (HBM3e: 4.8), 70B's 30.8 ns is 160 KiB at ~5 TB/s. The presets
# reserve KV for max_tokens, as the TensorRT-LLM runs they are fitted to did. The sim
# itself (`calibrate`, 3000 requests queued at once) lands within 5% of the published
# figures on the points checked (70B: all ten; 8B on H200: 128/128, 128/2048, 128/4096).
# KV capacity: (GPU memory x 0.9 - FP8 weights) / bytes per token of an FP8 KV cache
# (layers x KV heads x head_dim x 2 for K and V): 8B: 32x8x128x2 = 64 KiB/token;
# 70B: 80x8x128x2 = 160 KiB/token. The batch limits are TensorRT-LLM's default
# max_batch_size (2048) and max_num_tokens (8192).
SIM_PRESETS: dict[str, SimPreset] = {
    preset.name: preset
    for preset in (
        SimPreset(
            name="h200-llama3.1-8b-fp8",
            base_ms=5.3,
            per_seq_us=0.0,
            per_token_us=14.7,
            per_kv_token_ns=14.2,
            per_pair_ps=266.0,
            num_kv_blocks=(141 * 9 // 10 - 9) * 2**30 // (64 * 2**10 * BLOCK_SIZE),
            max_num_seqs=2048,
            max_num_batched_tokens=8192,
            max_model_len=131_072,
            reserve_max_tokens=True,
        ),
        SimPreset(
            name="h100-llama3.1-8b-fp8",
            base_ms=1.5,
            per_seq_us=0.0,
            per_token_us=14.2,
            per_kv_token_ns=23.1,
            per_pair_ps=458.0,
            num_kv_blocks=(80 * 9 // 10 - 9) * 2**30 // (64 * 2**10 * BLOCK_SIZE),
            max_num_seqs=2048,
            max_num_batched_tokens=8192,
            max_model_len=131_072,
            reserve_max_tokens=True,
        ),
        SimPreset(
            name="h200-llama3.3-70b-fp8",
            base_ms=12.8,
            per_seq_us=0.0,
            per_token_us=117.0,
            per_kv_token_ns=30.8,
            per_pair_ps=7740.0,
            num_kv_blocks=(141 * 9 // 10 - 70) * 2**30 // (160 * 2**10 * BLOCK_SIZE),
            max_num_seqs=2048,
            max_num_batched_tokens=8192,
            max_model_len=131_072,
            reserve_max_tokens=True,
        ),
    )
}
DEFAULT_PRESET = "h200-llama3.1-8b-fp8"
