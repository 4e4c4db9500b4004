"""Sampling parameters of one request: what the engine honours when it picks tokens.

Sits at the engine's edge: the worker builds one from a `GenerateRequest`, the scheduler
reads its limits, the sampler reads the rest. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range (permanent: the request is wrong)."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling controls, vLLM/OpenAI semantics.

    temperature 0 means greedy (argmax). top_k 0 (or -1) means off, top_p 1.0 means off.
    logprobs None means no logprobs; an int N returns the sampled token's logprob plus the
    N most likely alternatives (N may be 0). stop strings are matched on detokenized text
    and are not included in the output; stop_token_ids end the request and are not
    included either (like EOS).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.top_k < 0:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.temperature < 0.0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}")
