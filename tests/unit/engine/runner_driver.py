"""Test helpers: tiny Hugging Face models on disk, and a hand-rolled scheduler for the runner.

`save_hf_model` writes a transformers model plus our in-process tokenizer into a directory
our loader reads; `run_greedy` drives `ModelRunner.execute` with hand-built
`SchedulerOutput`s (shuffled block ids, optional prompt chunking), no engine core needed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from sluice.engine.core.outputs import ScheduledRequest, SchedulerOutput
from sluice.engine.core.request import Request
from sluice.engine.preset import CHAT_TEMPLATE, train_tokenizer
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams


def save_hf_model(model: Any, path: Path, **save_kwargs: Any) -> Path:
    """save_pretrained + tokenizer.json + chat template in tokenizer_config.json."""
    import json

    model.save_pretrained(path, **save_kwargs)
    train_tokenizer(min(512, model.config.vocab_size)).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )
    return path


def run_requests(
    runner: ModelRunner,
    requests: list[Request],
    chunk: int | None = None,
    seed: int = 0,
) -> list[Request]:
    """Run `requests` to max_tokens (EOS ignored) all in one batch; returns them."""
    bs = runner.block_size
    free = list(range(1, runner.num_kv_blocks))
    random.Random(seed).shuffle(free)
    tables: dict[str, list[int]] = {}
    for r in requests:
        need = -(-(r.num_prompt_tokens + r.sampling_params.max_tokens) // bs)
        tables[r.request_id], free = free[:need], free[need:]
        assert len(tables[r.request_id]) == need, "test KV cache too small"
    live = list(requests)
    while live:
        scheduled = []
        for r in live:
            n = r.num_tokens - r.num_computed_tokens
            if chunk is not None:
                n = min(n, chunk)
            sample = r.num_computed_tokens + n == r.num_tokens
            scheduled.append(
                ScheduledRequest(r, r.num_computed_tokens, n, tables[r.request_id], sample)
            )
        out = runner.execute(SchedulerOutput(scheduled, sum(s.num_new_tokens for s in scheduled)))
        by_id = {s.request_id: s for s in out.sampled}
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.sample:
                s.request.output_token_ids.append(by_id[s.request_id].token_id)
        live = [r for r in live if r.num_output_tokens < r.sampling_params.max_tokens]
    return requests


def run_greedy(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int, chunk: int | None = None
) -> list[list[int]]:
    reqs = [
        Request(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens))
        for i, p in enumerate(prompts)
    ]
    return [r.output_token_ids for r in run_requests(runner, reqs, chunk)]
