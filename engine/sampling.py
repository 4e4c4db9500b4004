"""Sampling parameters of one request: what the engine honours when it picks tokens.

Sits at the engine's edge: the worker builds one from a `GenerateRequest`, the scheduler
reads its limits, the sampler reads the rest. No torch here.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

# Seeds the engine accepts: the signed and the unsigned 64-bit range, so any seed an API
# client may send as int64 or uint64 works. A negative seed is its uint64 two's
# complement (`generator_seed`), as `torch.manual_seed` maps it.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20
MAX_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range (permanent: the request is wrong)."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match (`engine.structured` compiles it): kind is json_object,
    json_schema, regex, choice or grammar (bus.messages.StructuredSpec says what value
    holds for each); after: the constraint starts once the output holds this text."""

    kind: str
    value: str = ""
    after: str | None = None


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.top_k < 0:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before the draw
        (`engine.logits`): its steps then take fp32 logits and leave the fast paths."""
        return (
            self.min_tokens > 0
            or bool(self.logit_bias)
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.constraint is not None
        )

    @property
    def only_constrained(self) -> bool:
        """Whether a grammar is all that may change this request's logits (none included)."""
        return not (
            self.min_tokens > 0
            or self.logit_bias
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise SamplingParamsError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
                raise SamplingParamsError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"
                )
        if not (
            math.isfinite(self.repetition_penalty)
            and self.repetition_penalty >= sys.float_info.min  # a subnormal one overflows
        ):
            raise SamplingParamsError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        for token_id, bias in self.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token_id}"
                )
        if self.prompt_logprobs is not None and not (
            0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS
        ):
            raise SamplingParamsError(
                f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.constraint is not None and self.constraint.kind not in CONSTRAINT_KINDS:
            raise SamplingParamsError(
                f"structured output kind must be one of {CONSTRAINT_KINDS}, "
                f"got {self.constraint.kind!r}"
            )


def generator_seed(seed: int) -> int:
    """The uint64 a `torch.Generator` is seeded with: a negative seed's two's complement."""
    return seed & MAX_SEED
