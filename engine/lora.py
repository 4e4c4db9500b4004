"""LoRA adapters as the engine sees them: a request's adapter and its PEFT config. No torch.

A request names its adapter with a `LoRARequest` (the name it is served as and the PEFT
directory every worker of the pool reads); the scheduler gives it one of `max_loras`
slots (`engine.core.lora_slots`) and the runner loads its weights into that slot
(`engine.models.lora`). `read_lora_config` reads `adapter_config.json` and refuses what
the engine does not implement, so such a request fails alone, at submit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from sluice.engine.errors import RequestRejectedError

# the Llama-family projections an adapter may target (the Hugging Face module names)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAAdapterError(RequestRejectedError):
    """The request's adapter cannot be loaded or uses a PEFT feature the engine does not
    implement (permanent: that request fails, the engine carries on)."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The adapter a request runs with: its served name and its PEFT directory. Equal
    requests share a slot, KV blocks and prefix-cache hits; another path under the same
    name is another adapter (new weights)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """What the engine reads of an adapter's `adapter_config.json`.

    scale: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
    """

    rank: int
    scale: float
    target_modules: frozenset[str]


# adapter_config.json keys whose non-default values change the math; refused
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "a per-module rank (rank_pattern)",
    "alpha_pattern": "a per-module alpha (alpha_pattern)",
    "layers_to_transform": "layers_to_transform",
    "fan_in_fan_out": "fan_in_fan_out",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
}


def read_lora_config(lora: LoRARequest, max_rank: int) -> LoRAConfig:
    """The adapter's config, checked; raises LoRAAdapterError naming what is wrong."""
    directory = Path(lora.path)
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(
            f"adapter {lora.name!r}: cannot read {directory / CONFIG_FILE}: {exc}"
        ) from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"adapter {lora.name!r}: {CONFIG_FILE} is not a JSON object")

    def refuse(what: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"adapter {lora.name!r}: {what} is not supported")

    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type {peft_type!r}")
    if raw.get("bias", "none") != "none":
        raise refuse(f"bias={raw['bias']!r}")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise refuse(what)
    rank = raw.get("r")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoRAAdapterError(f"adapter {lora.name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"adapter {lora.name!r} has rank {rank}; this engine serves ranks up to "
            f"max_lora_rank={max_rank} (raise SLUICE_MAX_LORA_RANK)"
        )
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise refuse(f"target_modules {targets!r} (a list of module names is)")
    names = frozenset(str(t).rsplit(".", 1)[-1] for t in targets)
    if not names <= set(LORA_TARGETS):
        raise refuse(f"target_modules {sorted(names - set(LORA_TARGETS))} (only {LORA_TARGETS})")
    if not (directory / WEIGHTS_FILE).is_file():
        raise LoRAAdapterError(f"adapter {lora.name!r}: {directory / WEIGHTS_FILE} is missing")
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return LoRAConfig(rank, float(scale), names)
