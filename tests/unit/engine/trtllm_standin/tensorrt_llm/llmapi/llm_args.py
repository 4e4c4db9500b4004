"""Stand-in for `KvCacheConfig` (tensorrt_llm/llmapi/llm_args.py): the fields the backend sets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class KvCacheConfig:
    """KV cache settings; the real one is a pydantic model with many more fields."""

    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = 0.9
