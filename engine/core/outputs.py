"""What crosses from the scheduler to the runner and back, once per engine step.

The contract between `engine.core.scheduler` (no torch) and `engine.runner` (torch): the
scheduler says which tokens of which requests to compute and where their KV lives; the
runner answers with one sampled token per request that reached the end of its known
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engine.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens [start, start + num_new_tokens) of
    `request.prompt_token_ids + request.output_token_ids`, where `start` is
    `num_computed_tokens_before`, at positions start..start+n-1, writing their KV into the
    slots given by `block_ids` (slot = block_ids[pos // block_size] * block_size +
    pos % block_size). Attention for each new token covers positions [0, its own].
    `sample` is True when the chunk ends at the last known token, so the runner must
    sample one next token for this request. `block_ids` is the request's live block table
    (it grows in place between steps, no copy per step): read it during `execute`, never
    mutate it or keep it past the step.
    """

    request: Request
    num_computed_tokens_before: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    """The plan for one step. `scheduled` order is the row order of sampled outputs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # requests that left the engine since the last step (finished, aborted, preempted):
    # the runner drops per-request state (e.g. seeded generators) for finished ones
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledToken:
    """The runner's answer for one request that sampled this step."""

    request_id: str
    token_id: int
    logprob: float | None = None  # raw log-softmax of the sampled token, when asked
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), best first
    # the request's grammar is complete with this token: it ends 'stop' here (the token
    # is output, and text unless it is an EOS or stop token), min_tokens or not
    grammar_stop: bool = False


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs one step computed for a request (`SamplingParams.prompt_logprobs`):
    prompt tokens [start, start + len(logprobs)) each scored given the tokens before it
    (start >= 1), their ranks in the vocab (1 = most likely) and the top alternatives."""

    start: int
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[SampledToken] = field(default_factory=list)
    # request id -> the prompt logprobs of the chunk it prefilled this step
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # requests the runner could not serve (a grammar that does not compile): request id
    # -> why; they have no sampled token and end with 'error'
    failed: dict[str, str] = field(default_factory=dict)
