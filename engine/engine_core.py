"""One engine step, synchronously: schedule -> runner.execute -> update -> token deltas.

The middle of the engine: the backend's loop thread calls `step()` over and over;
`EngineCore` owns the `Scheduler` and a runner (anything with
`execute(SchedulerOutput) -> RunnerOutput`, torch or fake) and turns sampled tokens into
`EngineDelta`s: incremental detokenization, stop strings (held back until they cannot
be a stop-string prefix, never emitted), logprobs, prompt logprobs (gathered over a
prompt's prefill chunks, sent on its first token's delta), and exactly one terminal delta
per request with its usage counts. Not thread-safe: one thread drives it.

Stop checks, in order: a completed grammar (the runner says so; its last token is
output and text unless an EOS or stop token), EOS (unless ignore_eos; not before
min_tokens), stop_token_ids
(not before min_tokens), max_tokens, max_model_len (these four in the scheduler), then
stop strings (here, through the detokenizer). A stop string found on the token that
also hit a length limit makes the finish reason 'stop'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sluice.engine.backends.base import (
    EngineDelta,
    EngineLogprob,
    EngineRequest,
    EngineStats,
    FinishReason,
    check_request,
)
from sluice.engine.config import EngineConfig
from sluice.engine.core.outputs import (
    PromptLogprobsChunk,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from sluice.engine.core.request import Request, RequestStatus
from sluice.engine.core.scheduler import Scheduler
from sluice.engine.errors import RequestRejectedError

if TYPE_CHECKING:
    from sluice.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...


class Detokenizer(Protocol):
    """Per-request incremental detokenizer (engine.tokenizer.IncrementalDetokenizer)."""

    stop_reason: str | None

    def add_token(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


DetokenizerFactory = Callable[[Request], Detokenizer]


def tokenizer_detokenizers(tokenizer: Tokenizer) -> DetokenizerFactory:
    """A factory of `IncrementalDetokenizer`s over `tokenizer`, with each request's stops."""
    from sluice.engine.tokenizer import IncrementalDetokenizer

    def make(request: Request) -> Detokenizer:
        resumed = request.num_resumed_tokens
        prompt = request.prompt_token_ids
        if not resumed:
            return IncrementalDetokenizer(tokenizer, prompt, request.sampling_params.stop)
        # a resume: replay the earlier attempt's tokens from its own prompt, so the state
        # (a character still incomplete, text held back for stop strings) is the one that
        # attempt had; the replayed text was already published
        detokenizer = IncrementalDetokenizer(
            tokenizer, prompt[:-resumed], request.sampling_params.stop
        )
        detokenizer.add_tokens(prompt[-resumed:])
        return detokenizer

    return make


@dataclass(slots=True)
class _RequestState:
    request: Request
    detokenizer: Detokenizer | None
    want_logprobs: bool
    # filled chunk by chunk during the prefill, sent on the first token's delta (then None)
    prompt_logprobs: list[EngineLogprob | None] | None = None


class EngineCore:
    """Scheduler + runner + output processing for one engine.

    num_kv_blocks: the KV capacity the runner allocated (block 0 included); defaults to
    `runner.num_kv_blocks`, then to `config.num_kv_blocks`.
    vocab_size: the token ids the model embeds (`runner.vocab_size` by default); None
    leaves ids unchecked but for negatives (a fake runner).
    detokenizers: builds one detokenizer per request; None means no text (token ids only,
    stop strings ignored).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        *,
        num_kv_blocks: int | None = None,
        eos_token_ids: Sequence[int] = (),
        detokenizers: DetokenizerFactory | None = None,
        hash_seed: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if num_kv_blocks is None:
            num_kv_blocks = getattr(runner, "num_kv_blocks", None) or config.num_kv_blocks
        if num_kv_blocks is None:
            raise ValueError("num_kv_blocks is unknown: pass it, or set config.num_kv_blocks")
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(config, num_kv_blocks, hash_seed=hash_seed)
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size: int | None = vocab_size or getattr(runner, "vocab_size", None)
        self.eos_token_ids = tuple(eos_token_ids)
        self.detokenizers = detokenizers
        self._states: dict[str, _RequestState] = {}
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_first_tokens = 0  # requests that got their first token (this attempt's)
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    # -- requests --------------------------------------------------------------------
    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request; raises RequestRejectedError if it can never run."""
        check_request(engine_request, self.config.max_model_len, self.vocab_size)
        if engine_request.sampling_params.prompt_logprobs is not None and not getattr(
            self.runner, "computes_prompt_logprobs", False
        ):
            raise RequestRejectedError("this engine has no prompt_logprobs")
        lora = engine_request.lora_request
        if lora is not None and not (
            getattr(self.runner, "serves_lora", False) and self.config.max_loras > 0
        ):
            raise RequestRejectedError(
                f"adapter {lora.name!r}: this engine serves no LoRA adapters (max_loras=0)"
            )
        request = Request(
            request_id=engine_request.request_id,
            prompt_token_ids=list(engine_request.prompt_token_ids),
            sampling_params=engine_request.sampling_params,
            eos_token_ids=self.eos_token_ids,
            priority=engine_request.priority,
            deadline=engine_request.deadline,
            cache_salt=engine_request.cache_salt,
            num_resumed_tokens=min(
                engine_request.num_resumed_tokens, len(engine_request.prompt_token_ids)
            ),
            lora_request=lora,
        )
        detokenizer = self.detokenizers(request) if self.detokenizers is not None else None
        self.scheduler.add_request(request)
        prepare = getattr(self.runner, "add_request", None)
        if prepare is not None:
            try:
                prepare(request)  # e.g. starts compiling its grammar
            except Exception:
                self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
                raise
        elif request.sampling_params.constraint is not None:
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            raise RequestRejectedError("this engine has no structured outputs")
        prompt_logprobs: list[EngineLogprob | None] | None = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] * request.num_prompt_tokens
        self._states[request.request_id] = _RequestState(
            request, detokenizer, request.sampling_params.logprobs is not None, prompt_logprobs
        )

    def abort_request(self, request_id: str) -> bool:
        """Abort a live request; its terminal delta comes out of the next `step()`."""
        return bool(self.scheduler.abort_requests(request_id))

    def has_unfinished(self) -> bool:
        """True while some request still owes deltas (a terminal one at least)."""
        return bool(self._states)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def request_ids(self) -> list[str]:
        return list(self._states)

    # -- one step ----------------------------------------------------------------------
    def step(self) -> list[EngineDelta]:
        scheduler_output = self.scheduler.schedule()
        deltas: list[EngineDelta] = []
        states = self._states
        # finished outside a token: aborted, deadline passed, outgrew the KV cache
        for request_id in scheduler_output.finished_request_ids:
            state = states.pop(request_id, None)
            if state is not None:
                deltas.append(self._terminal(EngineDelta(request_id), state, None))
        if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
            return deltas
        runner_output = self.runner.execute(scheduler_output)
        self.num_steps += 1
        for request_id, error in runner_output.failed.items():
            state = states.pop(request_id, None)
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
            if state is not None:
                logger.warning("request_id=%s failed in the runner: %s", request_id, error)
                delta = self._terminal(EngineDelta(request_id), state, None)
                delta.finish_reason, delta.error = "error", error
                deltas.append(delta)
        for request_id, chunk in runner_output.prompt_logprobs.items():
            state = states.get(request_id)
            if state is not None and state.prompt_logprobs is not None:
                _store_prompt_logprobs(state, chunk)
        for request, sampled in self.scheduler.update_from_output(scheduler_output, runner_output):
            state = states.get(request.request_id)
            if state is not None:
                deltas.append(self._on_token(state, sampled))
        return deltas

    def _on_token(self, state: _RequestState, sampled: SampledToken) -> EngineDelta:
        request = state.request
        token_id = sampled.token_id
        self.num_generated_tokens += 1
        if len(request.output_token_ids) == 1:
            self.num_first_tokens += 1
        delta = EngineDelta(request.request_id, [token_id])
        if state.want_logprobs and sampled.logprob is not None:
            delta.logprobs = [EngineLogprob(token_id, sampled.logprob, sampled.top_logprobs or [])]
        if state.prompt_logprobs is not None:
            delta.prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
        status = request.status
        detokenizer = state.detokenizer
        stop_reason: str | int | None = None
        params = request.sampling_params
        if status == RequestStatus.FINISHED_STOPPED and (
            not sampled.grammar_stop
            or token_id in params.stop_token_ids
            or token_id in request.eos_token_ids
        ):
            # EOS or a stop token id: it ends the text and is not part of it
            if token_id in params.stop_token_ids:
                stop_reason = token_id
        elif detokenizer is not None:
            delta.text = detokenizer.add_token(token_id)
            if detokenizer.stop_reason is not None:
                stop_reason = detokenizer.stop_reason
                if not status.finished:
                    self.scheduler.finish_requests(
                        request.request_id, RequestStatus.FINISHED_STOPPED
                    )
                status = RequestStatus.FINISHED_STOPPED
        if not status.finished:
            return delta
        del self._states[request.request_id]
        return self._terminal(delta, state, stop_reason, status)

    def _terminal(
        self,
        delta: EngineDelta,
        state: _RequestState,
        stop_reason: str | int | None,
        status: RequestStatus | None = None,
    ) -> EngineDelta:
        request = state.request
        status = status or request.status
        if state.detokenizer is not None and state.detokenizer.stop_reason is None:
            delta.text += state.detokenizer.flush()
        delta.finish_reason = status.finish_reason  # type: ignore[assignment]
        delta.stop_reason = stop_reason
        delta.num_prompt_tokens = request.num_prompt_tokens
        delta.num_cached_tokens = max(request.num_cached_tokens, 0)
        delta.num_output_tokens = request.num_output_tokens
        self.num_prompt_tokens += request.num_prompt_tokens
        self.num_cached_tokens += max(request.num_cached_tokens, 0)
        logger.debug(
            "request_id=%s finished reason=%s prompt=%s cached=%s output=%s",
            request.request_id,
            delta.finish_reason,
            request.num_prompt_tokens,
            delta.num_cached_tokens,
            request.num_output_tokens,
        )
        return delta

    def abort_all(
        self, finish_reason: FinishReason = "abort", error: str | None = None
    ) -> list[EngineDelta]:
        """Terminal deltas for every live request, e.g. at shutdown or after a crash."""
        deltas: list[EngineDelta] = []
        self.scheduler.abort_requests(list(self._states))
        for request_id, state in list(self._states.items()):
            delta = self._terminal(EngineDelta(request_id), state, None)
            delta.finish_reason = finish_reason
            delta.error = error
            deltas.append(delta)
        self._states.clear()
        return deltas

    def stats(self, num_pending: int = 0) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            num_pending=num_pending,
            kv_usage=scheduler.kv_usage,
            num_kv_blocks=self.num_kv_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )


def _store_prompt_logprobs(state: _RequestState, chunk: PromptLogprobsChunk) -> None:
    """A prefill chunk's prompt logprobs into their places (a chunk recomputed after a
    preemption overwrites its own)."""
    out = state.prompt_logprobs
    assert out is not None
    prompt = state.request.prompt_token_ids
    for j, (logprob, rank, top) in enumerate(
        zip(chunk.logprobs, chunk.ranks, chunk.top_logprobs, strict=True)
    ):
        i = chunk.start + j
        out[i] = EngineLogprob(prompt[i], logprob, top, rank)
