"""Engine configuration: one validated record read by the scheduler, KV manager and runner.

Built once at engine start-up (by the backend or the worker's settings) and passed down;
no torch here, so `engine.core` can read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]

_DTYPES = ("float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")


class EngineConfigError(ValueError):
    """A configuration value is invalid (permanent: fix the setting and restart)."""


@dataclass(slots=True)
class EngineConfig:
    """How the engine schedules and where its KV cache lives.

    KV capacity: `num_kv_blocks` when set (tests force preemption with a small value),
    otherwise as many blocks as fit in `kv_cache_mb` (see `resolve_num_kv_blocks`; the
    runner knows the bytes per block). Block 0 is reserved as the null block, so the
    usable capacity is `num_kv_blocks - 1` blocks.

    max_model_len: the most tokens (prompt + output) one request may hold.
    long_prefill_token_threshold: 0 = off; otherwise at most this many prompt tokens of
    one request per step, so long prompts do not stall decodes.
    enable_chunked_prefill: off means a prompt is scheduled whole, so
    max_num_batched_tokens must cover max_model_len.
    priority_background_tokens: under the priority policy, while requests of a better
    priority than others are in the engine (and for `priority_hold_s` after the last one
    left), the others get at most this many tokens per step, so the steps that serve the
    urgent requests stay short: an interactive request's TTFT is about two steps. -1 = no
    cap. 8 and a 0.5 s hold keep interactive TTFT low at little cost to the others'
    throughput (`sluice bench serving` measures both).
    max_loras: LoRA adapters resident at once (their weights stacked per projection, so
    one step mixes them); a request whose adapter finds every slot held by running
    requests waits. 0 = no adapters. max_lora_rank: the largest adapter rank accepted.
    seed: the generator shared by requests without a `seed` of their own. None (the
    default) draws it from the OS once per engine, so no two engines (or restarts) sample
    alike; an int makes those draws reproducible (tests). A request's seed is its own.
    """

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_mb: float = 256.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    priority_background_tokens: int = 8
    priority_hold_s: float = 0.5
    max_loras: int = 4
    max_lora_rank: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def fail(message: str) -> None:
            raise EngineConfigError(message)

        if self.dtype not in _DTYPES:
            fail(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not self.device or self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            fail(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            fail(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            fail(
                f"num_kv_blocks must be >= 2 (block 0 is the null block), got "
                f"{self.num_kv_blocks}; leave it None to size the cache from kv_cache_mb"
            )
        if self.num_kv_blocks is None and self.kv_cache_mb <= 0:
            fail(f"kv_cache_mb must be > 0, got {self.kv_cache_mb}")
        if self.max_num_seqs < 1:
            fail(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            fail(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            fail(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            fail(
                f"with enable_chunked_prefill=False, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}), or a long prompt could never be scheduled; "
                f"raise the budget, lower max_model_len or enable chunked prefill"
            )
        if self.long_prefill_token_threshold < 0:
            fail(
                f"long_prefill_token_threshold must be >= 0 (0 = off), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.priority_background_tokens < -1:
            fail(
                f"priority_background_tokens must be >= 0, or -1 for no cap, got "
                f"{self.priority_background_tokens}"
            )
        if self.priority_hold_s < 0:
            fail(f"priority_hold_s must be >= 0, got {self.priority_hold_s}")
        if self.max_loras < 0:
            fail(f"max_loras must be >= 0 (0 = no LoRA adapters), got {self.max_loras}")
        if self.max_lora_rank < 1:
            fail(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.scheduling_policy not in _POLICIES:
            fail(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")

    @property
    def max_num_blocks_per_request(self) -> int:
        """Block-table width the runner must allow for (covers max_model_len tokens)."""
        return -(-self.max_model_len // self.block_size)

    def resolve_num_kv_blocks(self, bytes_per_block: int) -> int:
        """Number of KV blocks (null block included) for a block of `bytes_per_block` bytes.

        `num_kv_blocks` wins when set; otherwise `kv_cache_mb` is divided by the block size
        in bytes (2 x layers x block_size x kv_heads x head_dim x dtype bytes).
        """
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if bytes_per_block <= 0:
            raise EngineConfigError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        num_blocks = int(self.kv_cache_mb * 1024 * 1024) // bytes_per_block
        if num_blocks < 2:
            raise EngineConfigError(
                f"kv_cache_mb={self.kv_cache_mb} holds only {num_blocks} KV blocks of "
                f"{bytes_per_block} bytes; raise kv_cache_mb or set num_kv_blocks"
            )
        return num_blocks
