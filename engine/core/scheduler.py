"""The token-budget scheduler: which tokens of which requests run in the next step.

The heart of `EngineCore.step()`: `schedule()` -> runner -> `update_from_output()`. One
budget (`max_num_batched_tokens`) per step covers decodes and prompt chunks alike, as in
vLLM v1: each request has `num_computed_tokens` and a target (`num_tokens`); a step closes
part of that gap. Chunked prefill, prefix hits and resumes after preemption all fall out
of this one rule. No torch.

Per step:
1. Requests whose deadline passed finish with FINISHED_DEADLINE.
2. Running requests, in order: allocate KV for their next chunk; when KV is full, preempt
   (recompute) the lowest-priority, latest request and retry.
3. Waiting requests in policy order (only if nothing was preempted): prefix-cache lookup,
   allocate, admit; stop at the first that does not fit. Under the priority policy a
   waiting request may preempt a running one that ranks strictly below it. A request
   whose LoRA adapter gets no slot (every one held by running requests of other
   adapters, `engine.core.lora_slots`) is passed over and waits; those behind it go on.
   Priority policy, steps 2-3: while requests of the best priority present share the
   engine with worse ones (and `priority_hold_s` after), the worse ones get at most
   `priority_background_tokens` tokens per step, oldest running first (they keep their
   KV; the rest simply wait a step), and none in a step that prefills an urgent request
   (but never in two steps in a row).
   A step's time grows with its tokens, and an urgent request's TTFT is the step in
   flight when it arrives plus its own.
4. `num_computed_tokens` advances at once, so the next chunk can be planned next step.
`update_from_output` indexes newly computed full blocks, appends sampled tokens and runs
the token-level stop checks (a completed grammar, EOS, stop_token_ids, max_tokens,
max_model_len).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time

from sluice.engine.config import EngineConfig
from sluice.engine.core.hashing import BlockHasher
from sluice.engine.core.kv_cache_manager import KVCacheManager
from sluice.engine.core.lora_slots import LoRASlots
from sluice.engine.core.outputs import RunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from sluice.engine.core.request import Request, RequestStatus
from sluice.engine.core.request_queue import make_request_queue
from sluice.engine.errors import RequestRejectedError

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_kv_blocks: int, hash_seed: int | None = None
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.priority_policy = config.scheduling_policy == "priority"
        self.background_tokens = config.priority_background_tokens
        self.hold_s = config.priority_hold_s
        self._urgent: int | None = None  # the best priority while the cap is on
        self._urgent_seen = float("-inf")
        self._starved_last = False  # the last step gave worse requests no tokens
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.hasher = BlockHasher(config.block_size, hash_seed)
        self.enable_prefix_caching = config.enable_prefix_caching
        self.lora_slots = LoRASlots(config.max_loras)

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_counter = itertools.count()
        self._finished_request_ids: list[str] = []  # since the last schedule()
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        if request.request_id in self.requests:
            raise RequestRejectedError(f"request {request.request_id} is already in the engine")
        if num_prompt == 0:
            raise RequestRejectedError("prompt is empty")
        if num_prompt >= self.max_model_len:
            raise RequestRejectedError(
                f"prompt has {num_prompt} tokens; max_model_len={self.max_model_len} leaves "
                f"no room to generate (at most {self.max_model_len - 1} prompt tokens)"
            )
        max_blocks = self.kv_cache_manager.block_pool.num_blocks - 1
        if -(-num_prompt // self.block_size) > max_blocks:
            raise RequestRejectedError(
                f"prompt needs more KV blocks than the cache has ({max_blocks})"
            )
        if self.enable_prefix_caching:
            self.hasher.extend(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.deadline is not None:
            heapq.heappush(
                self._deadlines, (request.deadline, next(self._deadline_counter), request)
            )

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """Finish live requests (abort, deadline, stop string); unknown or done ids are ignored.

        Frees their blocks and reports them to the runner at the next `schedule()`.
        Returns the requests it finished.
        """
        assert status.finished
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def abort_requests(self, request_ids: str | list[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def expire_deadlines(self, now: float) -> list[Request]:
        """Finish every live request whose deadline is at or before `now`."""
        expired: list[Request] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if not request.is_finished:
                expired.extend(
                    self.finish_requests(request.request_id, RequestStatus.FINISHED_DEADLINE)
                )
        return expired

    def _free_request(self, request: Request) -> None:
        self._release_lora(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)

    # -- stats ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        return self.kv_cache_manager.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        self.expire_deadlines(now)
        output = SchedulerOutput()
        above = self._capped_above(now)
        # none at all in a step that prefills an urgent request (its TTFT is that step),
        # but never two such steps in a row: a stream of urgent arrivals starves no one
        tokens = self.background_tokens
        if above is not None and not self._starved_last and self._urgent_prefill(above):
            tokens = 0
        self._starved_last = tokens == 0
        cap = _Cap(above, tokens)
        budget = self._schedule_running(output, self.max_num_batched_tokens, cap)
        if not output.preempted_request_ids:
            budget = self._schedule_waiting(output, budget, cap)
        # advance progress now, so the next step can plan the next chunk
        for scheduled in output.scheduled:
            scheduled.request.num_computed_tokens += scheduled.num_new_tokens
        output.num_batched_tokens = self.max_num_batched_tokens - budget
        output.finished_request_ids = self._finished_request_ids
        self._finished_request_ids = []
        return output

    def _capped_above(self, now: float) -> int | None:
        """The priority above which requests are capped this step (None: no cap)."""
        if not self.priority_policy or self.background_tokens < 0:
            return None
        present = [r.priority for r in self.running]
        if len(self.waiting):
            present.append(self.waiting.peek().priority)
        if present and min(present) < max(present):
            self._urgent, self._urgent_seen = min(present), now
        elif self._urgent is not None and now - self._urgent_seen > self.hold_s:
            self._urgent = None
        return self._urgent

    def _urgent_prefill(self, above: int) -> bool:
        """Whether a request ranked at or above `above` still waits for its first token."""
        if len(self.waiting) and self.waiting.peek().priority <= above:
            return True
        return any(r.priority <= above and not r.output_token_ids for r in self.running)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, budget)

    def _schedule_running(self, output: SchedulerOutput, budget: int, cap: _Cap) -> int:
        kv = self.kv_cache_manager
        running = self.running
        scheduled_by_id: dict[str, ScheduledRequest] = {}
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            limit = cap.limit(request, budget)
            num_new = self._num_new_tokens(request, request.num_computed_tokens, limit)
            if num_new <= 0:  # capped this step, or waiting for nothing; keep it running
                i += 1
                continue
            while not kv.allocate_slots(request, num_new):
                if len(running) == 1:
                    # alone and still does not fit: the cache is smaller than this request
                    self.finish_requests(request.request_id, RequestStatus.FINISHED_LENGTH)
                    logger.warning(
                        "request_id=%s outgrew the KV cache (%s tokens); finished as length",
                        request.request_id,
                        request.num_tokens,
                    )
                    break
                victim = self._pick_victim()
                victim_index = running.index(victim)
                del running[victim_index]
                refunded = scheduled_by_id.pop(victim.request_id, None)
                if refunded is not None:
                    output.scheduled.remove(refunded)
                    budget += refunded.num_new_tokens
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; running[i] is now the next request
            scheduled = ScheduledRequest(
                request,
                request.num_computed_tokens,
                num_new,
                kv.get_block_ids(request.request_id),
                request.num_computed_tokens + num_new == request.num_tokens,
            )
            output.scheduled.append(scheduled)
            scheduled_by_id[request.request_id] = scheduled
            budget -= num_new
            cap.spend(request, num_new)
            i += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, cap: _Cap) -> int:
        # requests whose adapter got no slot: back in front of the queue, in their order
        passed_over: list[Request] = []
        try:
            return self._admit_waiting(output, budget, cap, passed_over)
        finally:
            for request in reversed(passed_over):
                self.waiting.prepend(request)

    def _admit_waiting(
        self, output: SchedulerOutput, budget: int, cap: _Cap, passed_over: list[Request]
    ) -> int:
        kv = self.kv_cache_manager
        waiting = self.waiting
        while len(waiting) and budget > 0:
            request = waiting.peek()
            if cap.limit(request, budget) <= 0:
                break  # capped; the queue is in priority order, so are those behind
            lora = request.lora_request
            if lora is not None and not self.lora_slots.can_acquire(lora):
                passed_over.append(waiting.pop())
                continue
            if len(self.running) >= self.max_num_seqs:
                refund = self._make_room_for(request, output)
                if refund < 0:
                    break
                budget += refund
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > cap.limit(request, budget):
                break
            num_new = self._num_new_tokens(request, num_hit_tokens, cap.limit(request, budget))
            while not kv.allocate_slots(request, num_new, hits):
                refund = self._make_room_for(request, output)
                if refund < 0:
                    if not self.running:  # nothing holds blocks: it can never fit
                        self.finish_requests(request.request_id, RequestStatus.FINISHED_LENGTH)
                        break
                    return budget
                budget += refund
                # the victim's blocks may have been our hits' only holders: look again
                hits, num_hit_tokens = kv.get_computed_blocks(request)
                num_new = self._num_new_tokens(request, num_hit_tokens, cap.limit(request, budget))
            if request.is_finished:
                continue
            waiting.pop()
            if lora is not None:
                request.lora_slot = self.lora_slots.acquire(lora)
                assert request.lora_slot is not None  # room was checked, and only grew
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            output.scheduled.append(
                ScheduledRequest(
                    request,
                    num_hit_tokens,
                    num_new,
                    kv.get_block_ids(request.request_id),
                    num_hit_tokens + num_new == request.num_tokens,
                )
            )
            budget -= num_new
            cap.spend(request, num_new)
        return budget

    def _make_room_for(self, request: Request, output: SchedulerOutput) -> int:
        """Priority policy: preempt the lowest running request if it ranks below `request`.

        Returns the budget refunded (the victim's tokens if it was scheduled this step),
        or -1 when nothing could be preempted.
        """
        if not self.priority_policy or not self.running:
            return -1
        victim = self._pick_victim()
        if (victim.priority, victim.arrival_time) <= (request.priority, request.arrival_time):
            return -1
        self.running.remove(victim)
        refund = 0
        for scheduled in output.scheduled:
            if scheduled.request is victim:
                output.scheduled.remove(scheduled)
                refund = scheduled.num_new_tokens
                break
        self._preempt(victim)
        output.preempted_request_ids.append(victim.request_id)
        return refund

    def _pick_victim(self) -> Request:
        if self.priority_policy:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self._release_lora(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        logger.debug("preempted request_id=%s", request.request_id)

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot is not None:
            assert request.lora_request is not None
            self.lora_slots.release(request.lora_request)
            request.lora_slot = None

    # -- after the step ------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[tuple[Request, SampledToken]]:
        """Index computed blocks, append sampled tokens, run token-level stop checks.

        Returns (request, sampled token) for every request that got a token, in runner
        order; requests that finished here have a finished status and no blocks left.
        """
        kv = self.kv_cache_manager
        if self.enable_prefix_caching:
            for scheduled in scheduler_output.scheduled:
                if scheduled.request.status == RequestStatus.RUNNING:
                    kv.cache_blocks(scheduled.request)
        requests = self.requests
        block_size = self.block_size
        results: list[tuple[Request, SampledToken]] = []
        for sampled in runner_output.sampled:
            request = requests.get(sampled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            request.output_token_ids.append(sampled.token_id)
            if self.enable_prefix_caching and request.num_tokens % block_size == 0:
                self.hasher.extend(request)
            status = self._check_stop(request, sampled)
            if status is not None:
                request.status = status
                self.running.remove(request)
                self._free_request(request)
            results.append((request, sampled))
        return results

    def _check_stop(self, request: Request, sampled: SampledToken) -> RequestStatus | None:
        params = request.sampling_params
        token_id = sampled.token_id
        if sampled.grammar_stop:
            return RequestStatus.FINISHED_STOPPED
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


class _Cap:
    """One step's allowance for requests ranked below the urgent ones (see the module doc)."""

    __slots__ = ("above", "left")

    def __init__(self, above: int | None, tokens: int) -> None:
        self.above, self.left = above, tokens

    def limit(self, request: Request, budget: int) -> int:
        if self.above is None or request.priority <= self.above:
            return budget
        return min(budget, self.left)

    def spend(self, request: Request, tokens: int) -> None:
        if self.above is not None and request.priority > self.above:
            self.left -= tokens
