"""A deterministic fake runner: a real `execute(SchedulerOutput) -> RunnerOutput` without torch.

It keeps a fake KV cache (one int per slot) that it writes through the block tables it
is given and reads back to pick the next token, so a wrong block table, a bad prefix hit
or a lost block changes the output just as it would with a real model. The next token
is a hash of the whole context, so outputs are equal under chunking, prefix caching and
preemption exactly when the bookkeeping is right.
"""

from __future__ import annotations

import time

from sluice.engine.core.outputs import RunnerOutput, SampledToken, SchedulerOutput

_MASK = (1 << 61) - 1


def _mix(prev: int, token_id: int, position: int) -> int:
    return (prev * 1_000_003 + token_id * 7919 + position + 1) & _MASK


class FakeRunner:
    def __init__(
        self, num_blocks: int, block_size: int, vocab_size: int = 97, step_delay_s: float = 0.0
    ) -> None:
        self.block_size = block_size
        self.step_delay_s = step_delay_s  # like a model forward, for tests that race the loop
        self.vocab_size = vocab_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.num_steps = 0
        self.max_batched_tokens_seen = 0
        self.finished_request_ids: list[str] = []

    def _slot(self, block_ids: list[int], position: int) -> int:
        block_id = block_ids[position // self.block_size]
        assert block_id != 0, "wrote through the null block"
        return block_id * self.block_size + position % self.block_size

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.num_steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.finished_request_ids.extend(scheduler_output.finished_request_ids)
        total = sum(s.num_new_tokens for s in scheduler_output.scheduled)
        assert total == scheduler_output.num_batched_tokens
        self.max_batched_tokens_seen = max(self.max_batched_tokens_seen, total)
        sampled: list[SampledToken] = []
        kv = self.kv
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            start = scheduled.num_computed_tokens_before
            end = start + scheduled.num_new_tokens
            block_ids = scheduled.block_ids
            assert len(block_ids) * self.block_size >= end, "block table too short"
            tokens = request.token_ids_slice(start, end)
            for offset, token_id in enumerate(tokens):
                position = start + offset
                prev = 0
                if position > 0:
                    prev_kv = kv[self._slot(block_ids, position - 1)]
                    assert prev_kv is not None, "read KV that was never written"
                    prev = prev_kv
                kv[self._slot(block_ids, position)] = _mix(prev, token_id, position)
            if scheduled.sample:
                assert end == request.num_tokens
                last = kv[self._slot(block_ids, end - 1)]
                assert last is not None
                sampled.append(SampledToken(request.request_id, last % self.vocab_size))
        return RunnerOutput(sampled)


def reference_tokens(prompt: list[int], num_tokens: int, vocab_size: int = 97) -> list[int]:
    """What FakeRunner generates for `prompt`, computed without any KV bookkeeping."""
    out: list[int] = []
    h = 0
    tokens = list(prompt)
    position = 0
    while len(out) < num_tokens:
        while position < len(tokens):
            h = _mix(h, tokens[position], position)
            position += 1
        token_id = h % vocab_size
        out.append(token_id)
        tokens.append(token_id)
    return out


class FakeTokenizer:
    """Token id n decodes to one letter; enough for `IncrementalDetokenizer`."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(token_text(t) for t in token_ids)


def token_text(token_id: int) -> str:
    return chr(ord("a") + token_id % 26)
