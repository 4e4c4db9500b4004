"""Stand-in for `tensorrt_llm.SamplingParams`: the fields the trtllm backend sets.

The real class is a kw_only dataclass of ~50 fields; these keep its names and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True

    def _stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
