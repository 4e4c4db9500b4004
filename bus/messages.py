"""Every message that crosses a process boundary (docs/architecture.md §4), one module.

Pydantic models with `extra="forbid"` and a `schema_version`; serialized as compact JSON
by `bus.codec`. Commands are imperative (`GenerateRequest`, `Cancel`); records of what
happened are nouns of the event (`TokenDelta`, `UsageRecord`, `TelemetryRecord`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.bus.topics import Lane

FinishReason = Literal["stop", "length", "abort", "deadline", "error"]
# `TokenDelta.error_code` of a request that no engine came up to run (the gateway: 503)
ENGINE_UNAVAILABLE = "engine_unavailable"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1


class StructuredSpec(BaseModel):
    """A constraint on the output, as it travels: the engine compiles it into a grammar
    (`engine/structured.py`); the upstream backend passes it on in its peer's dialect.

    kind → value: `json_object` → "" (any JSON object); `json_schema` → the schema as JSON
    text; `regex` → the pattern; `choice` → a JSON list of the allowed strings; `grammar`
    → a Lark grammar (llguidance's dialect). `after`: the constraint starts once the output
    holds this text (the end of a reasoning block, e.g. "</think>"); None: from the first
    token.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    value: str = ""
    after: str | None = None


class SamplingSpec(BaseModel):
    """Sampling parameters as they travel; the engine worker maps them to its own.

    Penalties and `logit_bias` as vLLM defines them: frequency and presence penalties count
    the output tokens, the repetition penalty prompt and output tokens; `logit_bias` maps
    token ids to values in [-100, 100] added to the logits. `prompt_logprobs`: the logprob
    of every prompt token (and the N most likely at each position), for completions' echo.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None


class AdapterRef(BaseModel):
    """A LoRA adapter a request runs with: its served name and the PEFT directory the
    worker loads it from when it is not resident (every worker of the pool reads it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: str


class GenerateRequest(Message):
    """Generate tokens for a tokenized prompt. Key: tenant_id. Topic: the lane's of the
    model's pool (`request_topic(lane, pool_id(model))`)."""

    request_id: str
    attempt: int = 0
    tenant_id: str
    key_id: str | None = None
    model: str  # the pool's base model, as served
    # None: the base model; else the adapter's name is what the client asked for
    adapter: AdapterRef | None = Field(default=None, exclude_if=lambda v: v is None)
    lane: Lane = Lane.STANDARD
    prompt_token_ids: list[int]
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    deadline_ms: int | None = None  # unix epoch milliseconds
    reply_to: str  # the reply target (a gateway instance) whose stream wants the tokens
    # the reply target sends heartbeats: a worker that never heard it, though heartbeats
    # flowed for the gateways' ttl, judges it gone (`consumers.gateway_liveness`)
    reply_beats: bool = Field(default=False, exclude_if=lambda v: not v)
    created_ms: int
    cache_salt: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    # tokens the client already received from an earlier attempt (failover resumes here)
    resume_token_ids: list[int] = Field(default_factory=list)
    # False for the later choices of one prompt (n > 1): a call's prompt is billed once
    bill_prompt: bool = True


class Cancel(Message):
    """Abort a request or every request of a batch, wherever it is."""

    request_id: str | None = None
    batch_id: str | None = None
    tenant_id: str
    reason: str = "cancelled"

    @model_validator(mode="after")
    def _one_target(self) -> Cancel:
        if (self.request_id is None) == (self.batch_id is None):
            raise ValueError("a Cancel names exactly one of request_id and batch_id")
        return self


class WorkerLoad(BaseModel):
    """An engine worker's backlog and measured rates, on its heartbeat; the gateway
    predicts a new request's time to first token from them (`api.slo`).

    queued_tokens / queued_requests: per lane, the prompt tokens and count of the
    requests this worker holds that have no first token yet (buffered or in the
    engine). prefill_tokens_per_s: prompt tokens brought to their first token per
    second while a backlog waited (an EWMA); None until measured. first_release_s: how
    long until the first of its running requests is expected to end (their mean decode
    time minus how long each has decoded), 0 when none runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    queued_tokens: dict[str, int] = Field(default_factory=dict)
    queued_requests: dict[str, int] = Field(default_factory=dict)
    num_running: int = 0
    prefill_tokens_per_s: float | None = None
    first_release_s: float = 0.0


class Heartbeat(Message):
    """A gateway or an engine worker is alive (`sluice.heartbeats.v1`, every
    `interval_ms`): workers cancel the requests of a gateway that went silent
    (`consumers.gateway_liveness`). A worker's carries its `load` (left out of the JSON
    when None, so a gateway's beat reads as before)."""

    sender_id: str  # the gateway id (its reply target) or the worker id
    role: Literal["gateway", "worker"]
    interval_ms: int
    load: WorkerLoad | None = Field(default=None, exclude_if=lambda v: v is None)
    # a gateway's: how long its parked streams wait for a resume (`api.resume`), which
    # workers add to its ttl before cancelling its requests (left out when 0)
    resume_window_ms: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0)
    # a gateway's: the requests of other gateways' streams it took over and reads on
    # their reply topics; they run on while it beats, however silent their own gateway
    follows: list[str] = Field(default_factory=list, exclude_if=lambda v: not v)
    # a worker's: the pool it serves (`pool_id` of its model); gateways judge each pool by
    # its own workers' beats
    pool: str | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int
    logprob: float


class TokenLogprob(BaseModel):
    """A sampled token's logprob on the wire; the engine keeps its own `EngineLogprob`
    (it imports nothing of ours), which `consumers.engine_outputs` converts to this."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """A prompt token's logprob given the tokens before it, its rank in the vocab (1 = most
    likely) and the most likely alternatives there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int
    logprob: float
    rank: int
    top: list[TopLogprob] = Field(default_factory=list)


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int


class TokenDelta(BaseModel):
    """New tokens of one request attempt; ordered by seq_no within (request_id, attempt).

    token_offset / text_offset are the absolute positions (in the whole completion, across
    attempts) of this delta's first token and first character: after a failover the
    gateway drops what it already delivered, and a higher attempt fences a lower one.

    prompt_logprobs (`SamplingSpec.prompt_logprobs`): one per prompt token, None for the
    first, on the first attempt's first delta; left out of the JSON when None, so readers
    that predate it still decode every other delta.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    attempt: int = 0
    seq_no: int
    token_offset: int = 0
    text_offset: int = 0
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )
    finish_reason: FinishReason | None = None
    error: str | None = None  # with finish_reason "error": a message fit for the client
    # with finish_reason "error": ENGINE_UNAVAILABLE when no engine came up to run it (the
    # gateway answers 503); left out when None, as prompt_logprobs is
    error_code: str | None = Field(default=None, exclude_if=lambda v: v is None)
    usage: Usage | None = None  # on the last delta only


class TokenDeltaBatch(Message):
    """All deltas for one reply target from one engine step, on `reply_topic(reply_to)`."""

    reply_to: str
    deltas: list[TokenDelta]


class Timings(BaseModel):
    """Unix epoch milliseconds of each stage of one attempt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queued_ms: int  # the gateway built the request (just before publishing it)
    scheduled_ms: int | None = None  # submitted to the engine
    first_token_ms: int | None = None
    finished_ms: int
    received_ms: int | None = None  # the engine worker polled it off the bus
    admitted_ms: int | None = None  # the worker took it from its fair queue


class UsageRecord(Message):
    """What one attempt bills. One per attempt that ends its request, finished or
    aborted (its prompt once, the tokens it generated); for an attempt that ended without
    ending the request (its worker killed, its partition lost, fenced, its engine dead),
    the worker that resumes the request publishes it
    (`consumers.engine_outputs.superseded_usage`) with `estimated` set: the tokens the
    progress store confirms it published, and no prompt. Summed over the attempts, the
    records equal the usage on the request's terminal delta, what its client is shown
    (docs/architecture.md §5.4). The ledger and the quota store keep one per
    (request_id, attempt): a replay changes nothing, and an attempt's own record replaces
    an estimate, whichever arrives first."""

    request_id: str
    attempt: int = 0
    tenant_id: str
    key_id: str | None = None
    model: str
    lane: Lane
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int
    finish_reason: FinishReason
    timings: Timings
    batch_id: str | None = None
    estimated: bool = False


class TelemetryRecord(Message):
    """Per-attempt timings for spans and metrics (tracing consumer). Its headers carry the
    trace context of the request record. The fields after `num_output_tokens` came later
    and have defaults, so older records still decode; `estimated` marks the record of an
    attempt whose worker died (published by the worker that resumed it, as its usage is:
    no scheduling timings, the tokens the progress store confirms)."""

    request_id: str
    attempt: int = 0
    tenant_id: str
    model: str
    lane: Lane
    worker_id: str
    timings: Timings
    num_prompt_tokens: int
    num_output_tokens: int
    key_id: str | None = None
    batch_id: str | None = None
    max_tokens: int | None = None
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    estimated: bool = False
