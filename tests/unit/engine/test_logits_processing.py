"""`engine.logits`: min_tokens, logit_bias and penalties against a reference written from
vLLM's formulas, on random logits; the ranges `SamplingParams` and `check_request` accept."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engine.backends.base import EngineRequest, RequestRejectedError, check_request
from sluice.engine.core.request import Request
from sluice.engine.logits import LogitsProcessor
from sluice.engine.sampling import SamplingParams, SamplingParamsError

VOCAB = 50
EOS = (1, 2)


def reference(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """One row, the obvious way (vLLM: min_tokens, logit_bias, then apply_penalties)."""
    p = request.sampling_params
    row = logits.clone()
    resumed = request.num_resumed_tokens
    n_prompt = len(request.prompt_token_ids) - resumed
    prompt = request.prompt_token_ids[:n_prompt]
    output = request.prompt_token_ids[n_prompt:] + request.output_token_ids
    if len(request.output_token_ids) < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
        for t in stops:
            row[t] = -math.inf
    for t, b in p.logit_bias.items():
        row[t] += b
    for t in range(VOCAB):
        if t in prompt or t in output:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        count = output.count(t)
        row[t] -= p.frequency_penalty * count
        row[t] -= p.presence_penalty * (count > 0)
    return row


def make_request(i: int, gen: torch.Generator, **params: object) -> Request:
    prompt = torch.randint(
        0, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen
    )
    output = torch.randint(
        0, VOCAB, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen
    )
    request = Request(
        f"r{i}",
        prompt.tolist(),
        SamplingParams(max_tokens=64, **params),  # type: ignore[arg-type]
        eos_token_ids=EOS,
    )
    request.output_token_ids = output.tolist()
    return request


CASES = [
    {"frequency_penalty": 0.7},
    {"presence_penalty": -1.5},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.6, "frequency_penalty": -0.4, "presence_penalty": 2.0},
    {"logit_bias": {3: 100.0, 7: -42.5, 0: 0.25}},
    {"min_tokens": 60, "stop_token_ids": [9]},
    {"min_tokens": 60, "ignore_eos": True, "stop_token_ids": [9]},
    {"min_tokens": 1},  # already has outputs, or not: the reference decides
    {"logit_bias": {4: 1.0}, "repetition_penalty": 1.1, "min_tokens": 20},
]


@pytest.mark.parametrize("seed", range(4))
def test_rows_match_the_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    requests = [make_request(i, gen, **case) for i, case in enumerate(CASES)]
    # a resumed attempt: its last prompt tokens are output for the penalties
    requests[2].num_resumed_tokens = min(3, len(requests[2].prompt_token_ids))
    requests[3].num_resumed_tokens = len(requests[3].prompt_token_ids) // 2
    n = len(requests) + 2  # two rows nobody processes
    logits = torch.randn(n, VOCAB, generator=gen) * 3
    expected = logits.clone()
    rows = list(range(1, len(requests) + 1))  # row 0 and the last are left alone
    for row, request in zip(rows, requests, strict=True):
        expected[row] = reference(logits[row], request)
    LogitsProcessor().apply(logits, rows, requests, {})
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-5)


def test_penalties_keep_minus_infinity() -> None:
    gen = torch.Generator().manual_seed(0)
    request = make_request(0, gen, repetition_penalty=1.5, frequency_penalty=-2.0, min_tokens=50)
    request.output_token_ids = [1, 1, 2]
    logits = torch.randn(1, VOCAB, generator=gen)
    LogitsProcessor().apply(logits, [0], [request], {})
    assert logits[0, 1] == -math.inf and logits[0, 2] == -math.inf


def test_validate_ranges() -> None:
    SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=5.0)
    SamplingParams(logit_bias={1: -100.0, 2: 100.0}, prompt_logprobs=0)
    SamplingParams(prompt_logprobs=20)
    for bad in (
        {"frequency_penalty": float("nan")},
        {"presence_penalty": 2.001},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("inf")},
        {"logit_bias": {1: 100.5}},
        {"prompt_logprobs": -1},
    ):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_check_request_refuses_logit_bias_ids_outside_the_vocab() -> None:
    ok = EngineRequest("a", [1, 2], SamplingParams(logit_bias={VOCAB - 1: 1.0}))
    check_request(ok, 128, VOCAB)
    bad = EngineRequest("b", [1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(RequestRejectedError, match="logit_bias"):
        check_request(bad, 128, VOCAB)
    with pytest.raises(RequestRejectedError, match="logit_bias"):
        check_request(EngineRequest("c", [1], SamplingParams(logit_bias={-1: 1.0})), 128, None)


def test_engine_refuses_what_it_cannot_serve() -> None:
    from sluice.engine.config import EngineConfig
    from sluice.engine.engine_core import EngineCore
    from sluice.engine.sampling import Constraint
    from tests.unit.engine.fakes import FakeRunner

    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64)
    core = EngineCore(config, FakeRunner(32, 4), hash_seed=0)
    for params in (
        SamplingParams(prompt_logprobs=1),  # a runner without prompt logprobs
        SamplingParams(constraint=Constraint("json_object")),  # a runner without grammars
    ):
        with pytest.raises(RequestRejectedError):
            core.add_request(EngineRequest("r", [1, 2, 3], params))
        assert not core.has_unfinished()


def test_a_loop_is_a_short_period_over_the_last_outputs() -> None:
    from sluice.engine.logits import LOOP_WINDOW, looping

    assert looping([7] * LOOP_WINDOW)
    assert looping([1, 2, 3] * 4)
    assert looping([5, 6] + [1, 2, 3, 4] * 3)
    assert not looping([1, 2, 3, 4, 5] * 3)  # a period of 5 is text, not a loop
    assert not looping([7] * (LOOP_WINDOW - 1))
