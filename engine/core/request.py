"""One request's state inside the engine: tokens, progress, status, KV bookkeeping.

Owned by the scheduler; the runner only reads it through `SchedulerOutput`. No torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from sluice.engine.lora import LoRARequest
from sluice.engine.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Everything at or above FINISHED_STOPPED is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 10  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 11  # max_tokens or max_model_len
    FINISHED_ABORTED = 12  # cancelled by the caller
    FINISHED_DEADLINE = 13  # its deadline passed before it finished

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason: stop, length, abort, deadline (None while live)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_DEADLINE: "deadline",
}


@dataclass(slots=True, eq=False)
class Request:
    """A generation request as the scheduler tracks it.

    priority: lower value is served first (vLLM convention); ties break on arrival_time.
    deadline: absolute `time.monotonic()` seconds, or None.
    cache_salt: mixed into the first block's hash so prefix-cache hits stay within a tenant.
    num_resumed_tokens: the last this-many prompt tokens are output an earlier attempt
    already generated (a failover resume); the detokenizer replays them.
    lora_request: the LoRA adapter it runs with (None: the base model); also mixed into
    the first block's hash. lora_slot: the adapter slot it holds while RUNNING.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    cache_salt: str | None = None
    num_resumed_tokens: int = 0
    lora_request: LoRARequest | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    lora_slot: int | None = None  # set by the scheduler while it holds the adapter's slot

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must score every prompt token: no prefix hit, none skipped. Once it
        has a token the prompt logprobs went out, and a recompute may hit the cache."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished
