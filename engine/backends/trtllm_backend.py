"""`TrtllmEngineBackend`: NVIDIA TensorRT-LLM's LLM API (PyTorch flow) behind `EngineBackend`.

Where the pipeline meets TensorRT-LLM (SLUICE_BACKEND=trtllm). The only module that
imports `tensorrt_llm`, lazily in `load()`, so the rest of Sluice installs and runs
without it. The signatures used are recorded, with the source version read, in
`trtllm_api.txt` beside this file; the tests run this backend on a stand-in with exactly
that surface.

Each submitted request becomes an asyncio task (`PerRequestBackend`: admission, abort,
deadline, usage and the engine's end are there) that iterates
`LLM.generate_async(prompt_token_ids, SamplingParams, streaming=True,
cache_salt=<tenant salt>, priority=<lane in [0, 1]>)`: one `RequestOutput` per engine
step, whose `outputs[0].token_ids_diff` and new text become the request's delta and
whose `finish_reason` its terminal one. The runtime cuts a stop string out of the text
only once it is complete, so text that could be the start of one is held back until the
next step shows it is not. Deltas that arrive in one pass of the loop go out as one
batch. A task that stops early (aborted, past its deadline) calls
`RequestOutput.abort()` on its way out. An error of one request (`RequestError`,
ValueError, TypeError) ends that request with 'error'; anything else raised by the
runtime means the engine died: every in-flight request ends with a retryable 'error',
`health()` turns False, `submit` raises EngineDeadError and `deltas()` ends.

`stats()` reads the runtime's iteration statistics (`LLM.get_stats_async`, read from each
request's first step: active and queued requests, KV blocks in use); before the first of
them, or when the runtime gives none, it falls back to its own in-flight count.

Not handled: a failover resume (`num_resumed_tokens`) detokenizes afresh at the boundary,
so a character split across it is not joined; a dead engine is not restarted here (not a
`RestartableBackend`: the worker's process is replaced instead).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.engine.backends.base import (
    EngineLogprob,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestRejectedError,
)
from sluice.engine.backends.per_request import LiveRequest, PerRequestBackend
from sluice.engine.sampling import Constraint, generator_seed

__all__ = ["TrtllmEngineBackend"]

logger = logging.getLogger(__name__)

# CompletionOutput.finish_reason (tensorrt_llm/executor/result.py) -> ours
_FINISH: dict[str | None, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "timeout": "deadline",
    "cancelled": "abort",
}
# raised for one request, the engine still serving the others
_REQUEST_ERRORS = ("RequestError", "ValueError", "TypeError")


@dataclass(slots=True)
class _Live(LiveRequest):
    """A request in flight: the runtime's stream and how much of its text went out."""

    output: Any = None  # tensorrt_llm RequestOutput, once generate_async returned
    num_text_sent: int = 0  # characters of the runtime's text already in deltas
    prefilled: bool = False


class TrtllmEngineBackend(PerRequestBackend[_Live]):
    """TensorRT-LLM's `LLM` on a Hugging Face model directory; see the module docstring.

    max_model_len: prompt + output tokens (the runtime's max_seq_len); max_num_seqs and
    max_num_batched_tokens: its max_batch_size and max_num_tokens. vocab_size: the ids
    `submit` accepts. kv_cache_fraction: the free GPU memory the KV cache takes
    (KvCacheConfig.free_gpu_memory_fraction); enable_block_reuse: prefix caching.
    stats_interval_s: how long a read of the runtime's statistics waits for the next
    iteration's before it stops (until the next request starts).
    """

    name = "trtllm"
    coalesce = True

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int,
        vocab_size: int | None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_fraction: float = 0.9,
        enable_block_reuse: bool = True,
        stats_interval_s: float = 2.0,
        guided_decoding_backend: str | None = None,
    ) -> None:
        super().__init__()
        self.model_dir = Path(model_dir)
        # "llguidance" (our grammars are its Lark) or "xgrammar"; None: structured
        # outputs are refused, as the runtime would refuse them
        self.guided_decoding_backend = guided_decoding_backend
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_fraction = kv_cache_fraction
        self.enable_block_reuse = enable_block_reuse
        self.stats_interval_s = stats_interval_s
        self.llm: Any = None
        self._sampling_params: Any = None  # tensorrt_llm.SamplingParams, once loaded
        self._request_kwargs: frozenset[str] = frozenset()
        self._llm_closed = False
        self._stats_task: asyncio.Task[None] | None = None
        self._stats_wake: asyncio.Event | None = None
        self._runtime: dict[str, Any] | None = None  # the latest iteration statistics

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs: Any) -> TrtllmEngineBackend:
        """A backend whose vocab_size comes from the checkpoint's config.json; loads it."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        backend = cls(model_dir, vocab_size=config.get("vocab_size"), **kwargs)
        backend.load()
        return backend

    # -- lifecycle -------------------------------------------------------------------
    def load(self) -> None:
        """Build the runtime (blocks while TensorRT-LLM loads the weights); once."""
        if self.llm is not None:
            return
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig

        self.llm = LLM(
            model=str(self.model_dir),
            backend="pytorch",
            max_batch_size=self.max_num_seqs,
            max_num_tokens=self.max_num_batched_tokens,
            max_seq_len=self.max_model_len,
            kv_cache_config=KvCacheConfig(
                enable_block_reuse=self.enable_block_reuse,
                free_gpu_memory_fraction=self.kv_cache_fraction,
            ),
            enable_iter_perf_stats=True,  # else get_stats_async yields nothing
            **(
                {"guided_decoding_backend": self.guided_decoding_backend}
                if self.guided_decoding_backend
                else {}
            ),
        )
        self._sampling_params = SamplingParams
        # priority arrived after cache_salt; pass each only where the installed version has it
        accepted = inspect.signature(self.llm.generate_async).parameters
        self._request_kwargs = frozenset({"cache_salt", "priority"} & set(accepted))
        missing = {"cache_salt", "priority"} - self._request_kwargs
        if missing:
            logger.warning("tensorrt_llm's generate_async lacks %s: not passed", sorted(missing))

    def _prepare(self) -> None:
        self.load()

    def _on_loop_start(self) -> None:
        assert self._loop is not None
        self._stats_wake = asyncio.Event()
        self._stats_task = self._loop.create_task(self._poll_stats(), name="sluice-trtllm-stats")

    def _on_end(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()

    def _release(self) -> None:
        self._close_llm()

    def _close_llm(self) -> None:
        with self._lock:
            llm, closed, self._llm_closed = self.llm, self._llm_closed, True
        if llm is not None and not closed:
            try:
                llm.shutdown()
            except Exception:
                logger.exception("tensorrt_llm LLM.shutdown failed")

    def _new_live(self, request: EngineRequest) -> _Live:
        return _Live(request)

    # -- one request -----------------------------------------------------------------
    async def _generate(self, live: _Live) -> None:
        request = live.request
        output = None
        try:
            output = self.llm.generate_async(
                request.prompt_token_ids,
                sampling_params=self._to_sampling_params(request),
                streaming=True,
                **self._extra_kwargs(request),
            )
            live.output = output
            async for result in output:
                if self._on_step(live, result):
                    return
            self._finish(live, "stop")  # the stream ended without a reason: treat as done
        finally:
            if output is not None and not output.finished:
                try:
                    output.abort()
                except Exception:  # the runtime is gone already
                    logger.debug("abort of request_id=%s failed", request.request_id)

    def _failed(self, live: _Live, exc: Exception) -> None:
        if type(exc).__name__ in _REQUEST_ERRORS:
            logger.warning("request_id=%s failed in tensorrt_llm: %s", live.request.request_id, exc)
            self._finish(live, "error", f"{type(exc).__name__}: {exc}")
        else:
            self._die(exc)

    def _on_step(self, live: _Live, result: Any) -> bool:
        """One RequestOutput of the stream; True once the request finished."""
        completion = result.outputs[0]
        if not live.prefilled:
            live.prefilled = True
            live.num_cached = int(getattr(result, "cached_tokens", 0) or 0)
            self._num_prompt_tokens += len(live.request.prompt_token_ids)
            self._num_cached_tokens += live.num_cached
            if self._stats_wake is not None:
                self._stats_wake.set()  # the runtime steps, and reports it: read on
        reason = None
        if result.finished:
            reason = _FINISH.get(completion.finish_reason, "stop")
        token_ids = list(completion.token_ids_diff)
        self._emit(
            live,
            token_ids,
            self._new_text(live, completion.text, finished=reason is not None),
            reason,
            stop_reason=completion.stop_reason if reason == "stop" else None,
            logprobs=self._logprobs(live, token_ids, completion),
        )
        return reason is not None

    @staticmethod
    def _logprobs(live: _Live, token_ids: list[int], completion: Any) -> list[EngineLogprob] | None:
        """The new tokens' logprobs: each a dict token id -> Logprob(logprob, rank), the
        sampled token's and the top k, or a plain float where the flow gives only that."""
        k = live.request.sampling_params.logprobs
        if k is None or not token_ids:
            return None
        out = []
        for token_id, entry in zip(token_ids, completion.logprobs_diff, strict=False):
            if not isinstance(entry, dict):
                out.append(EngineLogprob(token_id, float(entry)))
                continue
            sampled = entry.get(token_id)
            ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
            out.append(
                EngineLogprob(
                    token_id,
                    float(sampled.logprob) if sampled is not None else float("-inf"),
                    [(i, float(lp.logprob)) for i, lp in ranked[:k]],
                )
            )
        return out

    @staticmethod
    def _new_text(live: _Live, text: str, *, finished: bool) -> str:
        """The text not sent yet, less a tail that may grow into a stop string."""
        end = len(text)
        if not finished:
            for stop in live.request.sampling_params.stop:
                for size in range(min(len(stop) - 1, end), 0, -1):
                    if text.endswith(stop[:size]):
                        end = min(end, len(text) - size)
                        break
        if end <= live.num_text_sent:
            return ""  # nothing new, or the runtime cut a stop string out of what we held
        new, live.num_text_sent = text[live.num_text_sent : end], end
        return new

    def _check_supported(self, request: EngineRequest) -> None:
        """What TensorRT-LLM's public SamplingParams cannot express: refused up front."""
        params = request.sampling_params
        if request.lora_request is not None:
            # TensorRT-LLM takes adapters only into an LLM built with a LoRA config, which
            # this backend does not build: refused rather than run on the base weights
            raise RequestRejectedError(
                f"adapter {request.lora_request.name!r}: the trtllm backend serves no LoRA adapters"
            )
        if params.logit_bias:
            raise RequestRejectedError("the trtllm backend has no logit_bias")
        if params.prompt_logprobs is not None:
            raise RequestRejectedError("the trtllm backend has no prompt_logprobs")
        constraint = params.constraint
        if constraint is None:
            return
        if self.guided_decoding_backend is None:
            raise RequestRejectedError("the trtllm backend runs without guided decoding")
        if constraint.after is not None:
            raise RequestRejectedError("the trtllm backend cannot start a constraint after text")
        if constraint.kind == "grammar" and self.guided_decoding_backend != "llguidance":
            raise RequestRejectedError("grammar (Lark) needs guided_decoding_backend=llguidance")

    def _to_sampling_params(self, request: EngineRequest) -> Any:
        params = request.sampling_params
        # the runtime stops at max_seq_len; ask no further, so the reason reads 'length'
        room = self.max_model_len - len(request.prompt_token_ids)
        kwargs: dict[str, Any] = {
            "max_tokens": max(1, min(params.max_tokens, room)),
            "seed": None if params.seed is None else generator_seed(params.seed),
            "min_tokens": params.min_tokens or None,
            # ours counts the alternatives (0: the sampled token's only); at least one asked
            "logprobs": None if params.logprobs is None else max(1, params.logprobs),
            "stop": list(params.stop) or None,
            "stop_token_ids": list(params.stop_token_ids) or None,
            "ignore_eos": params.ignore_eos,
        }
        # only where set: the fields arrived over versions, and defaults need not travel
        if params.frequency_penalty:
            kwargs["frequency_penalty"] = params.frequency_penalty
        if params.presence_penalty:
            kwargs["presence_penalty"] = params.presence_penalty
        if params.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = params.repetition_penalty
        if params.constraint is not None:
            from tensorrt_llm.llmapi import GuidedDecodingParams

            kwargs["guided_decoding"] = GuidedDecodingParams(**guided_kwargs(params.constraint))
        if params.greedy:
            kwargs["top_k"] = 1  # TensorRT-LLM takes temperature > 0 only: greedy is top-1
        else:
            kwargs.update(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None
            )
        return self._sampling_params(**kwargs)

    def _extra_kwargs(self, request: EngineRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if "cache_salt" in self._request_kwargs and request.cache_salt is not None:
            kwargs["cache_salt"] = request.cache_salt
        if "priority" in self._request_kwargs:
            # lanes are 0 (interactive), 1, 2 (batch), lower first; TensorRT-LLM's
            # priority is a float in [0, 1], higher first, 0.5 by default
            kwargs["priority"] = min(1.0, max(0.0, 1.0 - 0.5 * request.priority))
        return kwargs

    # -- stats -----------------------------------------------------------------------
    async def _poll_stats(self) -> None:
        """Keep the latest iteration statistics while requests run.

        The runtime's statistics stream ends after `timeout` without a new iteration and
        stays ended until a submit re-opens it, so it is read from each request's first
        step (a submit just re-opened it, and iterations are coming) until it ends."""
        wake = self._stats_wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            try:
                async for stats in self.llm.get_stats_async(timeout=self.stats_interval_s):
                    self._runtime = stats
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("tensorrt_llm statistics unavailable; counting in flight")
                return

    def stats(self) -> EngineStats:
        runtime = self._runtime or {}
        kv = runtime.get("kvCacheStats") or {}
        num_blocks = int(kv.get("maxNumBlocks", 0))
        in_flight = len(self._live)
        if in_flight == 0:  # what the runtime said last is stale once nothing runs
            waiting = running = 0
            kv_usage = 0.0
        elif runtime:
            paused = (runtime.get("inflightBatchingStats") or {}).get("numPausedRequests", 0)
            waiting = int(runtime.get("numQueuedRequests", 0)) + int(paused)
            running = int(runtime.get("numActiveRequests", 0))
            kv_usage = int(kv.get("usedNumBlocks", 0)) / num_blocks if num_blocks else 0.0
        else:
            waiting, running, kv_usage = 0, in_flight, 0.0
        return EngineStats(
            num_waiting=waiting,
            num_running=running,
            num_pending=len(self._pending),
            kv_usage=kv_usage,
            num_kv_blocks=num_blocks,
            num_steps=int(runtime["iter"]) + 1 if "iter" in runtime else 0,  # iter counts from 0
            num_generated_tokens=self._num_generated_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_cached_tokens=self._num_cached_tokens,
        )


_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")


def guided_kwargs(constraint: Constraint) -> dict[str, Any]:
    """A `Constraint` as `tensorrt_llm.llmapi.GuidedDecodingParams` fields (a choice is a
    regex of its alternatives, escaped for any regex dialect)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": value}
    if kind == "regex":
        return {"regex": value}
    if kind == "grammar":
        return {"grammar": value}
    choices = json.loads(value)
    escaped = ("".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) for s in choices)
    return {"regex": "(?:" + "|".join(escaped) + ")"}
