"""A deterministic fake `EngineBackend` and a gateway-side stream collector for worker tests.

The worker's tests run on the sim backend (`sim_engine.py`); this fake stays for those
whose resumed request must continue exactly as the uninterrupted one (failover,
restart), which the sim's reply, a function of the prompt, does not, and for the billing
stack's gated steps (`GatedBackend`), which hold generation while aborts still end requests.

`FakeEngineBackend` is a real implementation of the protocol on asyncio (no thread):
every `step_s` it admits waiting requests up to `max_running`, ends aborted and expired
ones, and gives each running request one token. The next token is a hash of the whole
context (prompt + output so far), like a greedy language model, so a request resumed
with prompt + already generated tokens continues exactly as the uninterrupted one.
Each token's text is one letter. `greedy_tokens()` is the oracle. A prompt it ran
before hits its "prefix cache" for all tokens but the last, as a real one would (n > 1,
a resumed attempt).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from sluice.bus.codec import decode_as
from sluice.bus.messages import TokenDelta, TokenDeltaBatch
from sluice.engine.backends.base import EngineDeadError, EngineDelta, EngineRequest, EngineStats

VOCAB = 50
EOS = None  # the fake never emits EOS: requests end by length, stop ids, abort or deadline


def next_token(context: Sequence[int]) -> int:
    h = 7
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def token_text(token_id: int) -> str:
    return chr(ord("a") + token_id % 26)


def greedy_tokens(prompt: Sequence[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = next_token(context)
        out.append(t)
        context.append(t)
    return out


@dataclass(slots=True)
class _Live:
    request: EngineRequest
    output: list[int] = field(default_factory=list)
    aborted: bool = False
    num_cached_tokens: int = 0


class FakeEngineBackend:
    def __init__(
        self,
        step_s: float = 0.005,
        max_running: int = 8,
        kv_capacity_tokens: int = 100_000,
    ) -> None:
        self.step_s = step_s
        self.max_running = max_running
        self.kv_capacity_tokens = kv_capacity_tokens
        self.num_steps = 0
        self.submitted: list[EngineRequest] = []
        self.aborts: list[str] = []
        self._pending: list[EngineRequest] = []
        self._waiting: list[_Live] = []
        self._running: list[_Live] = []
        self._aborted: set[str] = set()
        self._cached_prompts: set[tuple[int, ...]] = set()
        self._queue: asyncio.Queue[list[EngineDelta] | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._dead = False

    # -- protocol -------------------------------------------------------------------
    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True

    def submit(self, request: EngineRequest) -> None:
        if self._stopping or self._dead:
            raise EngineDeadError("fake engine is not running")
        self.submitted.append(request)
        self._pending.append(request)

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self._aborted.add(request_id)

    async def deltas(self) -> AsyncIterator[list[EngineDelta]]:
        assert self._queue is not None, "start() first"
        while True:
            batch = await self._queue.get()
            if batch is None:
                return
            yield batch

    def stats(self) -> EngineStats:
        used = sum(len(x.request.prompt_token_ids) + len(x.output) for x in self._running)
        return EngineStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_pending=len(self._pending),
            kv_usage=min(1.0, used / self.kv_capacity_tokens),
            num_steps=self.num_steps,
        )

    def health(self) -> bool:
        return self._task is not None and not self._dead and not self._stopping

    def kill(self) -> None:
        """The engine dies: deltas() ends without terminal deltas (tests of worker death)."""
        self._dead = True

    # -- the loop -------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._queue is not None
        while not self._stopping and not self._dead:
            await asyncio.sleep(self.step_s)
            batch = self.step()
            if batch:
                self._queue.put_nowait(batch)
        if self._stopping and not self._dead:
            live = [*self._waiting, *self._running]
            live += [_Live(r) for r in self._pending]
            batch = [self._terminal(x, "abort") for x in live]
            if batch:
                self._queue.put_nowait(batch)
        self._queue.put_nowait(None)

    def step(self) -> list[EngineDelta]:
        self.num_steps += 1
        self._waiting.extend(_Live(r) for r in self._pending)
        self._pending.clear()
        out: list[EngineDelta] = []
        now = time.monotonic()
        for live in [*self._waiting, *self._running]:
            deadline = live.request.deadline
            reason = None
            if live.request.request_id in self._aborted:
                reason = "abort"
            elif deadline is not None and now >= deadline:
                reason = "deadline"
            if reason is not None:
                self._drop(live)
                out.append(self._terminal(live, reason))
        self._aborted.clear()
        while self._waiting and len(self._running) < self.max_running:
            live = self._waiting.pop(0)
            prompt = tuple(live.request.prompt_token_ids)
            if prompt in self._cached_prompts:
                live.num_cached_tokens = len(prompt) - 1
            self._cached_prompts.add(prompt)
            self._running.append(live)
        for live in list(self._running):
            out.append(self._generate(live))
        return out

    def _generate(self, live: _Live) -> EngineDelta:
        params = live.request.sampling_params
        token = next_token([*live.request.prompt_token_ids, *live.output])
        live.output.append(token)
        stopped = token in params.stop_token_ids
        text = "" if stopped else token_text(token)
        delta = EngineDelta(live.request.request_id, [token], text)
        if stopped or len(live.output) >= params.max_tokens:
            self._drop(live)
            done = self._terminal(live, "stop" if stopped else "length")
            delta.finish_reason = done.finish_reason
            delta.num_prompt_tokens = done.num_prompt_tokens
            delta.num_cached_tokens = live.num_cached_tokens
            delta.num_output_tokens = done.num_output_tokens
        return delta

    def _drop(self, live: _Live) -> None:
        for queue in (self._waiting, self._running):
            if live in queue:
                queue.remove(live)

    def _terminal(self, live: _Live, reason: str) -> EngineDelta:
        return EngineDelta(
            live.request.request_id,
            finish_reason=reason,  # type: ignore[arg-type]
            num_prompt_tokens=len(live.request.prompt_token_ids),
            num_cached_tokens=live.num_cached_tokens,
            num_output_tokens=len(live.output),
        )


@dataclass(slots=True)
class Stream:
    """What one client sees of one request under the gateway's rules."""

    attempt: int = -1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_terminal: int = 0
    deltas: list[TokenDelta] = field(default_factory=list)


class GatewayView:
    """Applies the gateway's rules: fencing by attempt, dedupe by absolute offsets."""

    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self.num_batches = 0

    def add_batch(self, value: bytes) -> TokenDeltaBatch:
        batch = decode_as(TokenDeltaBatch, value)
        self.num_batches += 1
        for delta in batch.deltas:
            self.add(delta)
        return batch

    def add(self, delta: TokenDelta) -> None:
        s = self.streams.setdefault(delta.request_id, Stream())
        s.deltas.append(delta)
        if delta.attempt < s.attempt or s.finish_reason is not None:
            return
        s.attempt = delta.attempt
        assert delta.token_offset <= len(s.token_ids), f"token gap in {delta}"
        assert delta.text_offset <= len(s.text), f"text gap in {delta}"
        s.token_ids.extend(delta.token_ids[len(s.token_ids) - delta.token_offset :])
        s.text += delta.text[len(s.text) - delta.text_offset :]
        if delta.finish_reason is not None:
            s.finish_reason = delta.finish_reason
            s.num_terminal += 1
