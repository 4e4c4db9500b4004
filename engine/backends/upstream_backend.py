"""`UpstreamEngineBackend`: OpenAI-compatible engine servers behind `EngineBackend`.

Where the pipeline meets an engine someone else runs (SLUICE_BACKEND=upstream): vLLM,
trtllm-serve, SGLang, llama.cpp's server, or another `sluice serve`. Each submitted
request becomes one streaming `POST {url}/v1/completions` with the token-id prompt and
`return_token_ids` (vLLM's name; `sluice serve` takes it too), served by an asyncio task
(`PerRequestBackend`: admission, abort, deadline, usage and the engine's end are there).
Each streamed chunk becomes one `EngineDelta` with the chunk's text and token ids; the
terminal delta carries the usage of the final chunk.

Several upstreams: a request goes to the healthy one with the fewest requests in flight.
An upstream that fails (connection refused, a 5xx, an error event, the stream cut mid-
way) is taken out until its health path (`GET /health`) answers 200 again (a health task
probes every upstream each `health_interval_s`), and the request resumes on another
healthy upstream: the tokens received so far are appended to the prompt, so the client
sees one uninterrupted output. A request that fails with no healthy upstream left kills
the backend as a dead engine would (in-flight requests end with a retryable 'error',
`health()` turns False, `deltas()` ends); `restart()` waits for an upstream to answer
again, so the engine worker resumes them there as after an engine restart. So does a
start where no upstream answers its health path at once: the backend dies rather than
say it is up, and its error names the servers and the fix.

A constrained request (`SamplingParams.constraint`) cannot move mid-output: the peer
would start its grammar afresh on the continuation. One that fails before any of its
output was emitted starts again from zero on another upstream; one that fails after ends
with 'error' (a 500 the client may retry), not marked `retryable`, since the worker would
only resume it mid-grammar again; a worker resume of one (`num_resumed_tokens`) is refused.

abort closes the request's stream (its task is cancelled). The upstreams' KV caches are
not visible from here: `stats().kv_usage` stays 0 and `num_kv_blocks` counts request
slots (`max_num_seqs` per upstream); backpressure comes from the worker's in-flight cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from sluice.engine.backends.base import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestRejectedError,
)
from sluice.engine.backends.per_request import LiveRequest, PerRequestBackend
from sluice.engine.sampling import Constraint

__all__ = ["Dialect", "UpstreamEngineBackend", "completion_body", "structured_body"]

logger = logging.getLogger(__name__)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}

# How an upstream hands back token ids. 'vllm' (vLLM, sluice serve) and 'sglang': with
# `return_token_ids`, each streamed choice carries `token_ids` beside its text; the two
# differ only in how a constraint is named (`structured_body`). 'trtllm' (trtllm-serve):
# its requests forbid unknown fields and give token ids only with `detokenize: false`
# (and then no text), so the text and stop strings are done here.
Dialect = Literal["vllm", "sglang", "trtllm"]


class _UpstreamFailed(Exception):
    """The upstream failed under the request (down, 5xx, cut stream): try another."""


class _Rejected(Exception):
    """The upstream refused the request itself (4xx): another would refuse it too."""


@dataclass(slots=True)
class _Upstream:
    url: str
    healthy: bool = True
    num_in_flight: int = 0


@dataclass(slots=True)
class _Live(LiveRequest):
    """One request in flight: what it has produced so far, across upstreams."""

    token_ids: list[int] = field(default_factory=list)
    delivered: bool = False  # a delta of its output was emitted (the client may have it)
    detokenizer: Any = None  # the 'trtllm' dialect's: text and stop strings made here


def completion_body(
    model: str | None,
    prompt: list[int],
    request: EngineRequest,
    num_generated: int,
    dialect: Dialect = "vllm",
) -> dict[str, Any]:
    """The `/v1/completions` body for `request`, `num_generated` tokens into its output.

    Sent: max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, min_tokens,
    ignore_eos (vLLM, SGLang and `sluice serve` take them all; OpenAI-only servers ignore
    the extras), cache_salt (vLLM's per-tenant prefix-cache salt), the penalties and
    logit_bias when set (all three peers take them; a resumed attempt's penalties see the
    earlier output as prompt, so frequency and presence counts start again), and the
    constraint (`structured_body`). Dropped: logprobs (the stream's logprobs are strings,
    not ids; prompt_logprobs are refused at `submit`) and priority (vLLM refuses
    priorities unless its scheduler runs the priority policy). The 'trtllm' dialect sends
    `detokenize: false` instead of return_token_ids, and neither stop strings (matched
    here, on text decoded here) nor cache_salt (not in its schema). A request with a LoRA
    adapter names the adapter as its model: vLLM (`--lora-modules NAME=PATH`) and
    `sluice serve` serve an adapter by its name.
    """
    params = request.sampling_params
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": params.max_tokens - num_generated,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if dialect == "trtllm":
        body["detokenize"] = False
    else:
        body["return_token_ids"] = True
    if request.lora_request is not None:
        body["model"] = request.lora_request.name
    elif model is not None:
        body["model"] = model
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop and dialect != "trtllm":
        body["stop"] = params.stop
    if params.stop_token_ids:
        body["stop_token_ids"] = params.stop_token_ids
    if params.min_tokens > num_generated:
        body["min_tokens"] = params.min_tokens - num_generated
    if params.ignore_eos:
        body["ignore_eos"] = True
    if request.cache_salt and dialect != "trtllm":
        body["cache_salt"] = request.cache_salt
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        body["logit_bias"] = {str(t): bias for t, bias in params.logit_bias.items()}
    if params.constraint is not None:
        body.update(structured_body(params.constraint, dialect))
    return body


def structured_body(constraint: Constraint, dialect: Dialect) -> dict[str, Any]:
    """The body fields that carry `constraint` to a peer of `dialect`; raises
    RequestRejectedError for what that peer cannot take (a permanent error).

    vllm: `structured_outputs` {json | regex | choice | grammar | json_object} (vLLM
    0.10+; Lark grammars go as they are, its xgrammar backend converts them). sglang:
    `json_schema` (text) or `regex`; a choice becomes a regex. trtllm: `response_format`
    {"type": "json", "schema"} / {"type": "json_object"} / {"type": "regex", "regex"}
    (trtllm-serve needs `guided_decoding_backend` set); a choice becomes a regex.
    SGLang and trtllm-serve read grammars as GBNF (xgrammar's EBNF), not Lark: refused.
    `after` (a reasoning block first) is not sent: vLLM and SGLang hold the grammar off
    until the end of reasoning themselves when started with a `--reasoning-parser` whose
    end marker is `after`; trtllm-serve's completions have no such parser: refused.
    """
    kind, value = constraint.kind, constraint.value
    if dialect == "trtllm" and constraint.after is not None:
        raise RequestRejectedError(
            "trtllm-serve's completions cannot start a constraint after a reasoning block"
        )
    if kind == "grammar" and dialect != "vllm":
        raise RequestRejectedError(
            f"the '{dialect}' upstream reads grammars as GBNF, not Lark: grammar constraints"
            " need a vLLM upstream or Sluice's own engine"
        )
    schema: Any = None
    choices: list[str] = []
    try:
        if kind == "json_schema":
            schema = json.loads(value)
        elif kind == "choice":
            choices = json.loads(value)
    except json.JSONDecodeError as exc:
        raise RequestRejectedError(f"{kind} constraint is not valid JSON: {exc}") from None
    if kind == "choice" and not (
        isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
    ):
        raise RequestRejectedError("a choice constraint is a non-empty JSON list of strings")
    if dialect == "vllm":
        field_value: Any = {
            "json_object": True,
            "json_schema": schema,
            "regex": value,
            "choice": choices,
            "grammar": value,
        }.get(kind)
        if field_value is None:
            raise RequestRejectedError(f"unknown constraint kind {kind!r}")
        name = "json" if kind == "json_schema" else kind
        return {"structured_outputs": {name: field_value}}
    regex = _choice_regex(choices) if kind == "choice" else value
    if dialect == "sglang":
        if kind == "json_object":
            return {"json_schema": json.dumps({"type": "object"})}
        if kind == "json_schema":
            return {"json_schema": value}
        if kind in ("regex", "choice"):
            return {"regex": regex}
    else:  # trtllm
        if kind == "json_object":
            return {"response_format": {"type": "json_object"}}
        if kind == "json_schema":
            return {"response_format": {"type": "json", "schema": schema}}
        if kind in ("regex", "choice"):
            return {"response_format": {"type": "regex", "regex": regex}}
    raise RequestRejectedError(f"unknown constraint kind {kind!r}")


def _choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (only metacharacters escaped: the
    peers' regex engines are not Python's, and `re.escape` escapes more)."""
    special = set("\\.^$*+?()[]{}|")
    escaped = ("".join("\\" + c if c in special else c for c in choice) for choice in choices)
    return "(" + "|".join(escaped) + ")"


class UpstreamEngineBackend(PerRequestBackend[_Live]):
    """OpenAI-compatible servers as one engine; see the module docstring for the contract.

    urls: the upstreams' base URLs (without `/v1`). model: the name to send (None: the
    first of the upstream's `/v1/models`). max_model_len, vocab_size (default: the
    tokenizer's): what `submit` checks locally (the served model's). max_resumes: how
    many times one request moves to another upstream before it fails. transport: httpx's
    (tests serve fake upstreams through it). dialect: see `Dialect`; 'trtllm' needs the
    tokenizer. health_path: what answers 200 once the upstream can serve: `/health` on
    vLLM, SGLang, trtllm-serve and llama.cpp; `/readyz` on `sluice serve` (its `/health`
    answers while the model still loads).
    """

    name = "upstream"
    coalesce = False  # each chunk goes out as it comes, so an abort lands before the next

    def __init__(
        self,
        urls: Sequence[str],
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_model_len: int = 2048,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        max_num_seqs: int = 64,
        health_interval_s: float = 1.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 120.0,
        restart_timeout_s: float = 30.0,
        max_resumes: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
        dialect: Dialect = "vllm",
        health_path: str = "/health",
    ) -> None:
        if not urls:
            raise ValueError("the upstream backend needs at least one upstream URL")
        super().__init__()
        self.upstreams = [_Upstream(url.rstrip("/")) for url in urls]
        self.model = model
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer  # the served model's: the gateway's, in embedded mode
        if vocab_size is None and tokenizer is not None:
            vocab_size = tokenizer.vocab_size
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.health_interval_s = health_interval_s
        self.restart_timeout_s = restart_timeout_s
        self.max_resumes = max_resumes
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._probe_timeout_s = connect_timeout_s
        self._transport = transport
        if dialect == "trtllm" and tokenizer is None:
            raise ValueError("the 'trtllm' dialect decodes text here: it needs the tokenizer")
        self.dialect: Dialect = dialect
        self.health_path = health_path
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._num_steps = 0
        self.num_resumes = 0  # requests moved to another upstream after one failed

    # -- lifecycle -------------------------------------------------------------------
    def _on_loop_start(self) -> None:
        assert self._loop is not None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            headers=self._headers, timeout=self._timeout, limits=limits, transport=self._transport
        )
        self._health_task = self._loop.create_task(self._probe_forever(), name="upstream-health")

    def _on_end(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._client is not None:
            client, self._client = self._client, None
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to close on
                self._loop.create_task(client.aclose())

    def restart(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """After the backend died: wait (blocking) until an upstream answers its health path,
        then serve again, `deltas()` read from `loop`."""
        if self._stopping:
            raise EngineDeadError("engine was shut down")
        if not self._closed:
            raise RuntimeError("restart() only after the engine died")
        until = time.monotonic() + self.restart_timeout_s
        while not self._probe_all_blocking():
            if self._stopping:  # shut down meanwhile: the worker stops, not waits
                raise EngineDeadError("engine was shut down")
            if time.monotonic() >= until:
                raise EngineDeadError(self.unanswered())
            time.sleep(min(0.5, self.health_interval_s))
        self._open(loop or asyncio.get_running_loop())

    def unanswered(self) -> str:
        """Why it cannot serve when no upstream answers its health path, and the fix."""
        urls = [u.url for u in self.upstreams]
        if len(urls) == 1:
            who = f"the upstream server at {urls[0]} does not answer its health check"
            probe = f"GET {urls[0]}{self.health_path}"
        else:
            who = f"none of the upstream servers ({', '.join(urls)}) answers its health check"
            probe = f"GET {self.health_path}"
        return (
            f"{who} ({probe}): start it, or point --upstream-url (SLUICE_UPSTREAM_URLS)"
            " at a server that runs"
        )

    def kill(self, error: BaseException) -> None:
        """Lose every upstream at once, as if all failed now (tests; from any thread)."""
        self._on_loop(self._die, error)

    def _can_serve(self) -> bool:
        return any(u.healthy for u in self.upstreams)

    def _new_live(self, request: EngineRequest) -> _Live:
        return _Live(request)

    def _check_supported(self, request: EngineRequest) -> None:
        if request.sampling_params.prompt_logprobs is not None:
            # the stream's logprobs are strings, not ids: refused rather than dropped
            raise RequestRejectedError("the upstream backend has no prompt_logprobs")
        if request.lora_request is not None and self.dialect == "trtllm":
            raise RequestRejectedError(
                f"adapter {request.lora_request.name!r}: the trtllm upstream serves no "
                f"LoRA adapters by name"
            )
        constraint = request.sampling_params.constraint
        if constraint is not None:
            structured_body(constraint, self.dialect)  # refused now, not on the loop
            if request.num_resumed_tokens:
                raise RequestRejectedError(
                    "a constrained output cannot resume on an upstream: the peer would"
                    " start its grammar afresh mid-output"
                )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._live),
            num_kv_blocks=self.max_num_seqs * len(self.upstreams),
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_cached_tokens=self._num_cached_tokens,
        )

    # -- one request -----------------------------------------------------------------
    async def _generate(self, live: _Live) -> None:
        """Stream `live` from the least-loaded healthy upstream, moving on when one fails."""
        request = live.request
        failure: Exception | None = None
        constrained = request.sampling_params.constraint is not None
        for _ in range(self.max_resumes + 1):
            upstream = self._pick()
            if upstream is None:
                break
            upstream.num_in_flight += 1  # before any await: the next pick sees it
            try:
                await self._attempt(live, upstream)
                return
            except _UpstreamFailed as exc:
                failure = exc
                upstream.healthy = False
                logger.warning(
                    "request_id=%s upstream %s failed after %s tokens: %s",
                    request.request_id,
                    upstream.url,
                    len(live.token_ids),
                    exc,
                )
                if constrained and live.delivered:
                    break  # its grammar state stays on the failed peer
                self.num_resumes += 1
            finally:
                upstream.num_in_flight -= 1
        if constrained and live.delivered:
            self._finish(
                live,
                "error",
                f"the upstream failed after {len(live.token_ids)} tokens of a constrained"
                f" output, which cannot continue on another upstream ({failure}); retry it",
            )
        if self._pick() is None:
            urls = ", ".join(u.url for u in self.upstreams)
            self._die(
                EngineDeadError(
                    f"every upstream server ({urls}) failed: {failure}; check that they run,"
                    " or point --upstream-url (SLUICE_UPSTREAM_URLS) at servers that do"
                )
            )
        else:
            self._finish(live, "error", f"failed on {self.max_resumes + 1} upstreams: {failure}")

    def _failed(self, live: _Live, exc: Exception) -> None:
        if isinstance(exc, _Rejected):
            self._finish(live, "error", str(exc))
            return
        # a bug or a malformed chunk: still one terminal delta
        logger.exception("request_id=%s failed in the upstream backend", live.request.request_id)
        self._finish(live, "error", f"{type(exc).__name__}: {exc}")

    def _pick(self) -> _Upstream | None:
        healthy = [u for u in self.upstreams if u.healthy]
        return min(healthy, key=lambda u: u.num_in_flight) if healthy else None

    async def _attempt(self, live: _Live, upstream: _Upstream) -> None:
        """One streamed completion on `upstream`, continuing where `live` stands."""
        request = live.request
        if len(live.token_ids) >= request.sampling_params.max_tokens:
            self._finish(live, "length")  # the stream was cut right after its last token
            return
        client = self._client
        assert client is not None
        if self.model is None:
            self.model = await self._served_model(client, upstream)
        prompt = [*request.prompt_token_ids, *live.token_ids]
        body = completion_body(self.model, prompt, request, len(live.token_ids), self.dialect)
        if self.dialect == "trtllm" and live.detokenizer is None:
            live.detokenizer = self._detokenizer(request)
        try:
            async with client.stream("POST", f"{upstream.url}/v1/completions", json=body) as resp:
                if resp.status_code >= 500 or resp.status_code == 429:
                    raise _UpstreamFailed(f"HTTP {resp.status_code}")
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _Rejected(f"upstream refused: HTTP {resp.status_code}: {resp.text}")
                self._num_prompt_tokens += len(prompt)
                await self._read(live, resp)
        except httpx.HTTPError as exc:
            raise _UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc

    async def _read(self, live: _Live, resp: httpx.Response) -> None:
        """Chunks to deltas until `[DONE]`; the terminal delta once it came."""
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, `: ping` comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError as exc:
                raise _UpstreamFailed(f"not JSON: {data[:80]!r}") from exc
            if "error" in chunk:
                raise _UpstreamFailed(f"error event: {chunk['error']}")
            usage = chunk.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                live.num_cached = details.get("cached_tokens") or 0
                self._num_cached_tokens += live.num_cached
            for choice in chunk.get("choices") or ():
                token_ids = choice.get("token_ids") or []
                text = choice.get("text") or ""
                detokenizer = live.detokenizer
                if detokenizer is not None:
                    text = detokenizer.add_tokens(token_ids)
                    if detokenizer.finished:  # a stop string: end it here, as vLLM would
                        self._deliver(live, token_ids, text)
                        self._finish(live, "stop", stop_reason=detokenizer.stop_reason)
                        return
                if token_ids or text:
                    self._num_steps += 1
                    self._deliver(live, token_ids, text)
                    # let the reader of deltas() act on it (an abort) before buffered
                    # chunks of this stream are read on
                    await asyncio.sleep(0)
                if choice.get("finish_reason") is not None:
                    finish = _FINISH.get(choice["finish_reason"], "stop")
                    # vLLM and trtllm-serve call it stop_reason, SGLang matched_stop
                    stop_reason = choice.get("stop_reason", choice.get("matched_stop"))
        if finish is None:
            raise _UpstreamFailed("the stream ended before the request finished")
        if live.detokenizer is not None and (tail := live.detokenizer.flush()):
            self._deliver(live, [], tail)
        self._finish(live, finish, stop_reason=stop_reason)

    def _deliver(self, live: _Live, token_ids: list[int], text: str) -> None:
        live.delivered = True
        live.token_ids.extend(token_ids)
        self._emit(live, token_ids, text)

    def _detokenizer(self, request: EngineRequest) -> Any:
        """Text for `request`'s new tokens, stop strings held back: a resume replays the
        earlier attempt's tokens first, as the engine's own detokenizer does."""
        from sluice.engine.tokenizer import IncrementalDetokenizer

        prompt, resumed = request.prompt_token_ids, request.num_resumed_tokens
        stop = request.sampling_params.stop
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt[: len(prompt) - resumed], stop)
        detokenizer.add_tokens(prompt[len(prompt) - resumed :])
        return detokenizer

    async def _served_model(self, client: httpx.AsyncClient, upstream: _Upstream) -> str:
        """The first model the upstream lists: what requests name when none was given."""
        try:
            resp = await client.get(f"{upstream.url}/v1/models")
        except httpx.HTTPError as exc:
            raise _UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200 or not resp.json().get("data"):
            raise _UpstreamFailed(f"/v1/models answered HTTP {resp.status_code}")
        return str(resp.json()["data"][0]["id"])

    # -- upstream health -------------------------------------------------------------
    async def _probe_forever(self) -> None:
        """Probe every upstream now, then each `health_interval_s`; none answering the
        first probe kills the backend (it is not up), as losing them all later does."""
        client = self._client
        assert client is not None
        results = await asyncio.gather(*(self._probe(client, u) for u in self.upstreams))
        if not any(results):
            self._die(EngineDeadError(self.unanswered()))
            return
        while True:
            await asyncio.sleep(self.health_interval_s)
            results = await asyncio.gather(*(self._probe(client, u) for u in self.upstreams))
            for upstream, ok in zip(self.upstreams, results, strict=True):
                if ok != upstream.healthy:
                    logger.warning("upstream %s is %s", upstream.url, "back" if ok else "down")
                upstream.healthy = ok

    async def _probe(self, client: httpx.AsyncClient, upstream: _Upstream) -> bool:
        try:
            resp = await client.get(
                f"{upstream.url}{self.health_path}", timeout=self._probe_timeout_s
            )
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _probe_all_blocking(self) -> bool:
        """Probe every upstream from this thread (restart); True when one is healthy."""
        for upstream in self.upstreams:
            try:
                resp = httpx.get(f"{upstream.url}{self.health_path}", timeout=self._probe_timeout_s)
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            upstream.healthy = ok
        return any(u.healthy for u in self.upstreams)
