"""`SimCore`: the sim engine's continuous-batching bookkeeping, stepped on a modelled clock.

What the sim backend (engine.backends.sim_backend) runs each step: `schedule()` picks the
step's tokens under one token budget, as vLLM v1 does (running requests first, then
waiting ones in arrival order; chunked prefill), allocates KV blocks for them and, when
the cache is full, preempts the newest running request back to the front of the waiting
queue (its KV is recomputed later); a preset with `reserve_max_tokens` instead admits a
request only once KV for its whole sequence is free, and never preempts. A new request
first looks its prompt up in the prefix cache (chained hashes of 16-token blocks, per
cache salt): hit blocks are neither allocated nor computed, and count as cached tokens.
The returned `SimStep` carries the step's modelled time; `finish_step()` then advances
the requests and emits their tokens.

Output tokens are deterministic and cheap: drawn from a fixed alphabet by a per-request
seed and the position. The seed is the prompt's (and the sampling seed's) when sampling
is greedy or seeded, so the same prompt gets the same reply, as from a real model; the
request id's otherwise. EOS only by a seeded draw when `eos_probability` > 0 (default:
never, so a request runs to max_tokens unless a stop token or string ends it). No torch,
no numpy.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sluice.engine.backends.base import (
    EngineDelta,
    EngineLogprob,
    EngineRequest,
    FinishReason,
    RequestRejectedError,
)
from sluice.engine.backends.sim.presets import SimPreset

_ALPHABET_SIZE = 256
_STRIDE = 40_503  # odd: walks the whole alphabet before a token repeats


def _alphabet(
    vocab_size: int, eos: set[int], detokenize: Callable[[int], str] | None
) -> dict[int, str]:
    """The tokens the sim emits and their text: ordinary ids from the middle of the
    vocabulary whose text is printable on its own (never EOS, never a partial byte)."""
    pieces: dict[int, str] = {}
    for token_id in range(vocab_size // 4, vocab_size):
        if token_id in eos:
            continue
        text = detokenize(token_id) if detokenize is not None else f" t{token_id}"
        if text and text.isprintable() and "\ufffd" not in text:
            pieces[token_id] = text
            if len(pieces) == _ALPHABET_SIZE:
                break
    if not pieces:
        raise ValueError(f"vocab_size={vocab_size} leaves no token to emit")
    return pieces


class KVBlocks:
    """KV blocks by count, and the prefix cache's hashed blocks by reference count.

    A hashed block is held (ref count > 0) or cached-free: free to reuse, still hit by
    a later prompt, evicted least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_free = num_blocks  # neither held nor cached
        self.refs: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_available(self) -> int:
        return self.num_free + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_available / self.num_blocks

    def num_hits(self, hashes: Sequence[int]) -> tuple[int, int]:
        """Leading `hashes` in the cache, and how many of those are cached-free."""
        hits = from_free = 0
        for block_hash in hashes:
            if block_hash in self.refs:
                hits += 1
            elif block_hash in self.evictable:
                hits += 1
                from_free += 1
            else:
                break
        return hits, from_free

    def acquire(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            if block_hash in self.evictable:
                del self.evictable[block_hash]
                self.refs[block_hash] = 1
            else:
                self.refs[block_hash] += 1

    def allocate(self, num: int) -> None:
        """Take `num` blocks (the caller checked `num_available`), evicting cached ones."""
        take = min(num, self.num_free)
        self.num_free -= take
        for _ in range(num - take):
            self.evictable.popitem(last=False)

    def cache(self, block_hash: int) -> bool:
        """Index one held, just computed block under `block_hash`; False if it already is."""
        if block_hash in self.refs or block_hash in self.evictable:
            return False
        self.refs[block_hash] = 1
        return True

    def release(self, hashes: Sequence[int], num_owned: int) -> None:
        self.num_free += num_owned
        for block_hash in reversed(hashes):  # the prompt's tail is evicted first
            count = self.refs[block_hash] - 1
            if count:
                self.refs[block_hash] = count
            else:
                del self.refs[block_hash]
                self.evictable[block_hash] = None


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's progress; `num_computed` tokens have KV, output grows by one a step."""

    request: EngineRequest
    seed: int
    num_prompt: int
    num_output: int = 0
    num_computed: int = 0
    num_cached_tokens: int = 0
    admitted: bool = False
    block_hashes: list[int] | None = None  # of the prompt's full blocks, on first admission
    held_hashes: list[int] = field(default_factory=list)  # cached blocks it holds
    num_owned: int = 0  # blocks it holds that are not (yet) cached
    num_indexed: int = 0  # leading prompt blocks offered to the prefix cache
    held_text: str = ""  # text held back while it may be the start of a stop string

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def num_blocks(self) -> int:
        return len(self.held_hashes) + self.num_owned


@dataclass(slots=True)
class SimStep:
    """What one step holds: (request, new tokens) pairs and the step's modelled time."""

    scheduled: list[tuple[SimRequest, int]]
    time_s: float


class SimCore:
    """Requests in, one scheduled step at a time; see the module docstring."""

    def __init__(
        self,
        preset: SimPreset,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        detokenize: Callable[[int], str] | None = None,
        eos_probability: float = 0.0,
    ) -> None:
        self.preset = preset
        self.block_size = preset.block_size
        self.max_model_len = max_model_len
        self.kv = KVBlocks(preset.num_kv_blocks)
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_probability = eos_probability
        self.pieces = _alphabet(vocab_size, set(self.eos_token_ids), detokenize)
        self.alphabet = list(self.pieces)
        self.requests: dict[str, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._deadlines: list[tuple[float, int, SimRequest]] = []
        self._counter = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    # -- requests in ---------------------------------------------------------------
    def check_fits(self, request: EngineRequest) -> None:
        """Reject a request whose longest sequence could never fit the whole KV cache."""
        longest = min(
            len(request.prompt_token_ids) + request.sampling_params.max_tokens,
            self.max_model_len,
        )
        if -(-longest // self.block_size) > self.kv.num_blocks:
            raise RequestRejectedError(
                f"{longest} tokens exceed the KV cache ({self.preset.kv_capacity_tokens} tokens)"
            )

    def add(self, request: EngineRequest) -> bool:
        """Queue `request`; False (ignored) if its id is already live."""
        if request.request_id in self.requests:
            return False
        params = request.sampling_params
        if params.greedy or params.seed is not None:
            seed = hash((params.seed, *request.prompt_token_ids)) & 0xFFFF_FFFF
        else:
            seed = zlib.crc32(request.request_id.encode())
        sim = SimRequest(request, seed, len(request.prompt_token_ids))
        self.requests[request.request_id] = sim
        self.waiting.append(sim)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._counter), sim))
        return True

    def abort(self, request_id: str, reason: FinishReason = "abort") -> EngineDelta | None:
        sim = self.requests.get(request_id)
        if sim is None:
            return None
        if sim in self.running:
            self.running.remove(sim)
        else:
            self.waiting.remove(sim)
        return self._finish(sim, reason)

    def abort_all(self, reason: FinishReason, error: str | None) -> list[EngineDelta]:
        deltas = [self._finish(sim, reason) for sim in [*self.running, *self.waiting]]
        self.running.clear()
        self.waiting.clear()
        for delta in deltas:
            delta.error = error
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------
    def expire(self, now: float) -> list[EngineDelta]:
        """Finish every live request whose deadline is at or before `now`."""
        expired: list[EngineDelta] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, sim = heapq.heappop(heap)
            if self.requests.get(sim.request_id) is sim:
                delta = self.abort(sim.request_id, "deadline")
                if delta is not None:
                    expired.append(delta)
        return expired

    def schedule(self) -> SimStep:
        """Pick this step's tokens, allocate their KV (preempting when full), time it."""
        budget = self.preset.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        running, kv = self.running, self.kv
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            sim = running[index]
            num_new = min(sim.num_tokens - sim.num_computed, budget)
            need = max(self._num_blocks_for(sim.num_computed + num_new) - sim.num_blocks, 0)
            while need > kv.num_available:
                preempted = True
                victim = running.pop()  # the newest: it has waited least
                self._preempt(victim)
                if victim is sim:
                    break
            else:
                kv.allocate(need)
                sim.num_owned += need
                scheduled.append((sim, num_new))
                budget -= num_new
                index += 1
                continue
            break
        if not preempted:
            budget = self._admit(scheduled, budget)
        return SimStep(scheduled, self._step_time(scheduled))

    def _admit(self, scheduled: list[tuple[SimRequest, int]], budget: int) -> int:
        """Waiting requests in order while they fit the budget, the batch and the KV."""
        kv, size = self.kv, self.block_size
        while self.waiting and budget > 0 and len(self.running) < self.preset.max_num_seqs:
            sim = self.waiting[0]
            if sim.block_hashes is None:
                sim.block_hashes = self._block_hashes(sim.request)
            # at least one prompt token is computed, so the step samples the next token
            hashes = sim.block_hashes[: (sim.num_prompt - 1) // size]
            hits, from_free = kv.num_hits(hashes)
            num_computed = hits * size
            num_new = min(sim.num_tokens - num_computed, budget)
            num_held = num_computed + num_new
            if self.preset.reserve_max_tokens:
                params = sim.request.sampling_params
                num_held = min(sim.num_prompt + params.max_tokens, self.max_model_len)
            need = self._num_blocks_for(num_held) - hits
            if need > kv.num_available - from_free:
                break
            self.waiting.popleft()
            kv.acquire(hashes[:hits])
            kv.allocate(need)
            sim.held_hashes = hashes[:hits]
            sim.num_owned = need
            sim.num_computed = num_computed
            sim.num_indexed = hits
            if not sim.admitted:
                sim.admitted = True
                sim.num_cached_tokens = num_computed
                self.num_prompt_tokens += sim.num_prompt
                self.num_cached_tokens += num_computed
            self.running.append(sim)
            scheduled.append((sim, num_new))
            budget -= num_new
        return budget

    def _step_time(self, scheduled: list[tuple[SimRequest, int]]) -> float:
        num_tokens = kv_read = pairs = 0
        for sim, num_new in scheduled:
            num_tokens += num_new
            kv_read += sim.num_computed + num_new
            if num_new > 1:
                pairs += num_new * (sim.num_computed + num_new // 2)
        return self.preset.step_time_s(len(scheduled), num_tokens, kv_read, pairs)

    def finish_step(self, step: SimStep) -> list[EngineDelta]:
        """The step ran: advance its requests, emit their tokens and finished requests."""
        self.num_steps += 1
        deltas: list[EngineDelta] = []
        size, kv = self.block_size, self.kv
        for sim, num_new in step.scheduled:
            if self.requests.get(sim.request_id) is not sim:
                continue  # finished while the step ran (not from this loop: defensive)
            sim.num_computed += num_new
            hashes = sim.block_hashes
            if hashes is not None and sim.num_indexed < len(hashes):
                full = min(sim.num_computed // size, len(hashes))
                # index the prompt's newly computed blocks for later prompts; a block
                # another request cached meanwhile stays this one's own
                for block_hash in hashes[sim.num_indexed : full]:
                    if kv.cache(block_hash):
                        sim.held_hashes.append(block_hash)
                        sim.num_owned -= 1
                sim.num_indexed = max(sim.num_indexed, full)
            if sim.num_computed == sim.num_tokens:
                deltas.append(self._emit(sim))
        self.num_generated_tokens += len(deltas)
        return deltas

    # -- tokens out ----------------------------------------------------------------
    def _emit(self, sim: SimRequest) -> EngineDelta:
        """One new token for `sim`; the terminal delta if it ends the request."""
        params = sim.request.sampling_params
        position = sim.num_output
        sim.num_output += 1
        alphabet = self.alphabet
        index = (sim.seed + position * _STRIDE) % len(alphabet)
        token_id = alphabet[index]
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        text = ""
        if sim.num_output >= params.min_tokens:
            if self.eos_probability and not params.ignore_eos and self._draw_eos(sim, position):
                token_id, reason = self.eos_token_ids[0], "stop"
            elif token_id in params.stop_token_ids:
                reason, stop_reason = "stop", token_id
        if reason is None:
            text = self.pieces[token_id]
            if params.stop:
                text, stop_reason = self._match_stop(sim, text, params.stop)
                if stop_reason is not None:
                    reason = "stop"
        if reason is None and (
            sim.num_output >= params.max_tokens or sim.num_tokens >= self.max_model_len
        ):
            reason = "length"
            text += sim.held_text
        logprobs = None
        if params.logprobs is not None:
            size = len(alphabet)
            top = [(alphabet[(index + k) % size], -1.0 - k) for k in range(params.logprobs)]
            logprobs = [EngineLogprob(token_id, -1.0, top)]
        if reason is None:
            return EngineDelta(sim.request_id, [token_id], text, logprobs)
        self.running.remove(sim)
        delta = self._finish(sim, reason)
        delta.token_ids, delta.text, delta.logprobs = [token_id], text, logprobs
        delta.stop_reason = stop_reason
        return delta

    def _draw_eos(self, sim: SimRequest, position: int) -> bool:
        if not self.eos_token_ids:
            return False
        draw = ((sim.seed ^ (position * 0x9E3779B1)) * 2_654_435_761) & 0xFFFFFFFF
        return draw < self.eos_probability * 2**32

    @staticmethod
    def _match_stop(sim: SimRequest, text: str, stops: list[str]) -> tuple[str, str | None]:
        """Text to send now, and the stop string that ends the request (text before it);
        holds back a tail that may be the start of a stop string."""
        pending = sim.held_text + text
        found = [(pending.find(stop), stop) for stop in stops if stop in pending]
        if found:
            at, stop = min(found)
            sim.held_text = ""
            return pending[:at], stop
        keep = max(len(stop) for stop in stops) - 1
        cut = max(len(pending) - keep, 0)
        sim.held_text = pending[cut:]
        return pending[:cut], None

    # -- internals -----------------------------------------------------------------
    def _finish(self, sim: SimRequest, reason: FinishReason) -> EngineDelta:
        del self.requests[sim.request_id]
        self.kv.release(sim.held_hashes, sim.num_owned)
        sim.held_hashes, sim.num_owned = [], 0
        return EngineDelta(
            sim.request_id,
            finish_reason=reason,
            num_prompt_tokens=sim.num_prompt,
            num_cached_tokens=sim.num_cached_tokens,
            num_output_tokens=sim.num_output,
        )

    def _preempt(self, sim: SimRequest) -> None:
        """Back to the front of the waiting queue; its KV is recomputed when it resumes
        (its prompt's cached blocks may still hit)."""
        self.kv.release(sim.held_hashes, sim.num_owned)
        sim.held_hashes, sim.num_owned, sim.num_computed = [], 0, 0
        self.waiting.appendleft(sim)
        self.num_preemptions += 1

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: EngineRequest) -> list[int]:
        """Chained hashes of the prompt's full blocks, seeded by the cache salt."""
        size, prompt = self.block_size, request.prompt_token_ids
        parent = hash(request.cache_salt)
        hashes = []
        for start in range(0, len(prompt) - size + 1, size):
            parent = hash((parent, *prompt[start : start + size]))
            hashes.append(parent)
        return hashes
