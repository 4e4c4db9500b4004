"""EngineConfig validation: each bad value is named in the message, with the fix."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.config import EngineConfig, EngineConfigError


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"kv_cache_mb": 0}, "kv_cache_mb"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}, "chunked prefill"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_bad_values_are_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**overrides)


def test_kv_blocks_come_from_the_memory_budget_unless_set() -> None:
    assert EngineConfig(kv_cache_mb=1.0).resolve_num_kv_blocks(1024) == 1024
    assert EngineConfig(num_kv_blocks=10).resolve_num_kv_blocks(1024) == 10
    with pytest.raises(EngineConfigError, match="kv_cache_mb"):
        EngineConfig(kv_cache_mb=0.001).resolve_num_kv_blocks(1 << 20)
    assert EngineConfig(max_model_len=33, block_size=16).max_num_blocks_per_request == 3
