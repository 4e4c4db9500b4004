"""Stand-in for `tensorrt_llm.LLM` and its streaming `RequestOutput`, on a toy model.

Behaves as the real LLM API does where the trtllm backend looks (tensorrt_llm/llmapi/llm.py,
tensorrt_llm/executor/result.py): `generate_async(..., streaming=True)` returns a
`RequestOutput` whose async iteration yields itself once per engine step, with
`outputs[0].token_ids_diff` the step's new tokens, `finish_reason` in stop/length/cancelled
on the last one and `cached_tokens` the prompt tokens found in the KV cache; `abort()`
cancels it; `get_stats_async(timeout)` returns the iteration statistics as dicts with the
real JSON keys. An executor thread steps the batch (in-flight batching up to
max_batch_size, the rest queued by priority; a request is admitted only when the KV blocks
for its prompt and max_tokens are free, as the default GUARANTEED_NO_EVICT policy does),
and hands responses to each result's asyncio queue, as the real executor's proxy does.

The toy model: token i of a request is (prompt[-1] * 7 + 11 * i) % 90 + 3, never an id
below 3; its text is " t<id>". `_standin_fail(error)` is the tests' switch that makes the
engine die: every live result raises `error` at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorrt_llm.llmapi.llm_args import KvCacheConfig
from tensorrt_llm.sampling_params import SamplingParams

DEFAULT_REQUEST_PRIORITY = 0.5
TOKENS_PER_BLOCK = 16
STEP_S = 0.003  # one engine step of the toy model

# TorchLlmArgs fields the stand-in accepts, of the many the real one does
_LLM_ARGS = {
    "backend",
    "kv_cache_config",
    "max_batch_size",
    "max_num_tokens",
    "max_seq_len",
    "enable_iter_perf_stats",
}


def toy_token(prompt: list[int], index: int) -> int:
    return (prompt[-1] * 7 + 11 * index) % 90 + 3


def toy_piece(token_id: int) -> str:
    return f" t{token_id}"


@dataclass(slots=True)
class Logprob:
    """A token's logprob and its rank in the vocabulary (tensorrt_llm/executor/result.py)."""

    logprob: float
    rank: int | None = None


def toy_logprobs(token_id: int, k: int) -> dict[int, Logprob]:
    """The sampled token and the k most likely (the sampled one first, -0.5 each rank)."""
    top = {
        (token_id + r) % 90 + 3 if r else token_id: Logprob(-0.5 * (r + 1), r + 1) for r in range(k)
    }
    top.setdefault(token_id, Logprob(-0.5, 1))
    return top


@dataclass(slots=True)
class CompletionOutput:
    """One sequence of a request (tensorrt_llm/executor/result.py)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list[dict[int, Logprob]]:
        return self.logprobs[self._last_logprobs_len :]


@dataclass(slots=True)
class _Response:
    token_ids: list[int]
    cached_tokens: int
    finish_reason: str | None = None  # the executor's: stop, length, cancelled
    stop_reason: int | None = None
    error: BaseException | None = None


class RequestOutput:
    """The streaming result of one `generate_async` (GenerationResult + RequestOutput)."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        executor: _Executor,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.cached_tokens = 0
        self._outputs = [CompletionOutput(0)]
        self._done = False
        self._aborted = False
        self._executor = executor
        self._loop = asyncio.get_running_loop()  # real: has_event_loop() picks the AsyncQueue
        self._aqueue: asyncio.Queue[_Response] = asyncio.Queue()

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def _put(self, response: _Response) -> None:
        """From the executor thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, response)

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        response = await self._aqueue.get()
        self._handle_response(response)
        return self

    def _handle_response(self, response: _Response) -> None:
        if response.error is not None:
            raise response.error
        output = self._outputs[0]
        output._last_token_ids_len = len(output.token_ids)
        output._last_text_len = len(output.text)
        output._last_logprobs_len = len(output.logprobs)
        output.token_ids.extend(response.token_ids)
        if self.sampling_params.logprobs:
            k = self.sampling_params.logprobs
            output.logprobs.extend(toy_logprobs(t, k) for t in response.token_ids)
        self.cached_tokens = response.cached_tokens
        self._done = response.finish_reason is not None
        if response.finish_reason is not None:
            output.finish_reason = response.finish_reason
            output.stop_reason = response.stop_reason
        if self.sampling_params.detokenize:
            output.text += "".join(toy_piece(t) for t in response.token_ids)
            # stop strings are matched on the text, after the executor, as the real result does
            for stop in self.sampling_params._stop_strings():
                if stop in output.text and output.finish_reason != "stop":
                    output.text = output.text[: output.text.find(stop)]
                    output.finish_reason, output.stop_reason = "stop", stop
                    self.abort()
                    self._done = True
                    break


class IterationResult:
    """Iteration statistics as JSON dicts; iteration ends after `timeout` without one."""

    def __init__(self) -> None:
        self._done = False
        self._timeout = 2.0
        self._lock = threading.Lock()
        self._pending: deque[str] = deque(maxlen=1000)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue[str] | None = None

    def set_timeout(self, timeout: float) -> None:
        self._timeout = timeout

    def mark_undone(self) -> None:
        self._done = False

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is loop:
                return
            self._loop, self._aqueue = loop, asyncio.Queue()
            while self._pending:
                self._aqueue.put_nowait(self._pending.popleft())

    def _put(self, data: str) -> None:
        """From the executor thread."""
        with self._lock:
            if self._loop is None or self._aqueue is None:
                self._pending.append(data)
                return
            loop, queue = self._loop, self._aqueue
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(queue.put_nowait, data)

    def __aiter__(self) -> IterationResult:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done or self._aqueue is None:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout(self._timeout):
                data = await self._aqueue.get()
        except TimeoutError:
            self._done = True
            raise StopAsyncIteration from None
        result: dict[str, Any] = json.loads(data)
        return result


@dataclass(slots=True)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    result: RequestOutput
    priority: float
    salt: str | None
    arrival: int
    num_blocks: int
    cached_tokens: int = 0
    outputs: list[int] = field(default_factory=list)


class _Executor:
    """The engine: a thread stepping the in-flight batch of the toy model."""

    def __init__(self, max_batch_size: int, num_blocks: int, block_reuse: bool, stats: bool):
        self.max_batch_size = max_batch_size
        self.num_blocks = num_blocks
        self.block_reuse = block_reuse
        self.stats_enabled = stats
        self.stats = IterationResult()
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._aborts: set[int] = set()
        self._cached: set[tuple[str | None, tuple[int, ...]]] = set()
        self._error: BaseException | None = None
        self._stopped = False
        self._iter = 0
        self._arrivals = itertools.count()
        self._thread = threading.Thread(target=self._run, name="standin-executor", daemon=True)
        self._thread.start()

    def is_shutdown(self) -> bool:
        return self._stopped

    def submit(self, request: _Request) -> None:
        with self._cond:
            if self._error is not None:
                request.result._put(_Response([], 0, error=self._error))
                return
            self._waiting.append(request)
            self._cond.notify()

    def abort_request(self, request_id: int) -> None:
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopped or self._error or self._aborts or self._waiting or self._running
                ):
                    self._cond.wait()
                if self._stopped:
                    return
                if self._error is not None:
                    for request in self._waiting + self._running:
                        request.result._put(_Response([], 0, error=self._error))
                    self._waiting, self._running = [], []
                    return
                self._apply_aborts()
                self._admit()
                batch = list(self._running)
            if not batch:
                continue
            time.sleep(STEP_S)
            with self._cond:
                self._step(batch)

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, set()
        for queue in (self._waiting, self._running):
            for request in [r for r in queue if r.id in aborts]:
                queue.remove(request)
                request.result._put(_Response([], request.cached_tokens, "cancelled"))

    def _admit(self) -> None:
        self._waiting.sort(key=lambda r: (-r.priority, r.arrival))
        free = self.num_blocks - sum(r.num_blocks for r in self._running)
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting[0]
            if request.num_blocks > free:
                break
            self._waiting.pop(0)
            free -= request.num_blocks
            request.cached_tokens = self._cached_prefix(request)
            self._running.append(request)

    def _cached_prefix(self, request: _Request) -> int:
        if not self.block_reuse:
            return 0
        cached = 0
        for end in range(TOKENS_PER_BLOCK, len(request.prompt), TOKENS_PER_BLOCK):
            if (request.salt, tuple(request.prompt[:end])) not in self._cached:
                break
            cached = end
        return cached

    def _step(self, batch: list[_Request]) -> None:
        """One iteration: a token for each request in the batch; the iteration's stats go
        out before its responses (the order the tests' stats checks rely on)."""
        responses: list[tuple[_Request, _Response]] = []
        for request in batch:
            if request not in self._running:
                continue  # aborted while the step ran
            token = toy_token(request.prompt, len(request.outputs))
            request.outputs.append(token)
            params = request.params
            reason: str | None = None
            stop_reason = None
            if params.stop_token_ids and token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif len(request.outputs) >= params.max_tokens:
                reason = "length"
            responses.append(
                (request, _Response([token], request.cached_tokens, reason, stop_reason))
            )
        if self.stats_enabled:
            self.stats._put(json.dumps(self._snapshot()))
        for request, response in responses:
            request.result._put(response)
            if response.finish_reason is not None:
                self._running.remove(request)
                self._remember(request)
        self._iter += 1  # counts from 0, as the runtime's does

    def _remember(self, request: _Request) -> None:
        if self.block_reuse:
            for end in range(TOKENS_PER_BLOCK, len(request.prompt) + 1, TOKENS_PER_BLOCK):
                self._cached.add((request.salt, tuple(request.prompt[:end])))

    def _snapshot(self) -> dict[str, Any]:
        used = sum(r.num_blocks for r in self._running)
        return {
            "iter": self._iter,
            "numActiveRequests": len(self._running),
            "numQueuedRequests": len(self._waiting),
            "kvCacheStats": {
                "maxNumBlocks": self.num_blocks,
                "usedNumBlocks": used,
                "freeNumBlocks": self.num_blocks - used,
                "tokensPerBlock": TOKENS_PER_BLOCK,
            },
            "inflightBatchingStats": {"numPausedRequests": 0},
        }


class LLM:
    """Stand-in for `tensorrt_llm.LLM` (the PyTorch flow): a toy model in a thread."""

    def __init__(
        self,
        model,
        tokenizer=None,
        tokenizer_mode="auto",
        skip_tokenizer_init=False,
        trust_remote_code=False,
        tensor_parallel_size=1,
        dtype="auto",
        revision=None,
        tokenizer_revision=None,
        **kwargs,
    ):
        for key in kwargs:
            if key not in _LLM_ARGS:  # as BaseLLM checks against the args' model_fields
                raise ValueError(f"LLM got invalid argument: {key}")
        self.model = Path(model)
        self.args = dict(kwargs)
        kv: KvCacheConfig = kwargs.get("kv_cache_config") or KvCacheConfig()
        fraction = kv.free_gpu_memory_fraction or 0.9
        self._executor = _Executor(
            max_batch_size=kwargs.get("max_batch_size") or 2048,
            num_blocks=max(1, int(512 * fraction)),
            block_reuse=kv.enable_block_reuse,
            stats=bool(kwargs.get("enable_iter_perf_stats")),
        )
        self._ids = itertools.count(1)

    def generate_async(
        self,
        inputs,
        sampling_params=None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming=False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        trace_headers=None,
        _postproc_params=None,
        scheduling_params=None,
        conversation_params=None,
        cache_salt=None,
        priority=DEFAULT_REQUEST_PRIORITY,
    ):
        if self._executor.is_shutdown():
            raise RuntimeError("LLM is shutting down")
        if not isinstance(inputs, list) or not all(isinstance(t, int) for t in inputs):
            raise TypeError("the stand-in takes prompt token ids only")
        if not 0.0 <= priority <= 1.0:
            raise ValueError(f"priority must be a float in [0.0, 1.0], got {priority}")
        params = sampling_params or SamplingParams()
        result = RequestOutput(next(self._ids), list(inputs), params, self._executor)
        blocks = -(-(len(inputs) + params.max_tokens) // TOKENS_PER_BLOCK)
        if blocks > self._executor.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks, the cache has fewer")
        self._executor.stats.mark_undone()
        self._executor.submit(
            _Request(
                result.request_id,
                list(inputs),
                params,
                result,
                priority,
                cache_salt,
                next(self._executor._arrivals),
                blocks,
            )
        )
        return result

    def get_stats_async(self, timeout=2):
        stats = self._executor.stats
        stats._bind(asyncio.get_running_loop())
        stats.set_timeout(timeout or 2)
        return stats

    def shutdown(self):
        self._executor.shutdown()

    def _standin_fail(self, error: BaseException) -> None:
        """Tests only: the engine dies; every live request raises `error` next step."""
        self._executor.fail(error)
