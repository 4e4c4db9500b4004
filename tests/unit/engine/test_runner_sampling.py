"""Sampler and runner sampling: greedy, top-k/top-p, per-request seeds, logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.core.request import Request
from sluice.engine.loader import load_model
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampler import Sampler
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.runner_driver import run_requests


def _logits() -> torch.Tensor:
    return torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_and_degenerate_filters_are_argmax() -> None:
    logits = _logits()
    want = logits.argmax(-1).tolist()
    s = Sampler(seed=0)
    greedy = [SamplingParams(temperature=0.0)] * 4
    assert s.sample(logits, greedy, [None] * 4).token_ids == want
    top1 = [SamplingParams(temperature=1.0, top_k=1)] * 4
    assert s.sample(logits, top1, [None] * 4).token_ids == want
    tiny_p = [SamplingParams(temperature=0.7, top_p=1e-6)] * 4
    assert s.sample(logits, tiny_p, [None] * 4).token_ids == want


def test_top_k_restricts_the_support() -> None:
    logits = _logits()[:1].repeat(200, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    out = Sampler(seed=1).sample(logits, [SamplingParams(top_k=3)] * 200, [None] * 200)
    assert set(out.token_ids) <= allowed and len(set(out.token_ids)) > 1


def test_seeded_rows_do_not_depend_on_neighbours() -> None:
    logits = _logits()
    p = SamplingParams(temperature=1.0, seed=7)

    def draw(row: int, batch: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        gens: list[torch.Generator | None] = [None] * batch
        gens[row] = g
        params = [SamplingParams(temperature=1.5)] * batch
        params[row] = p
        batch_logits = logits[:1].repeat(batch, 1)
        return [Sampler().sample(batch_logits, params, gens).token_ids[row] for _ in range(6)]

    assert draw(0, 1) == draw(2, 4)


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits[:2], params, [None, None])
    lp = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == pytest.approx(lp.max().item(), abs=1e-5)
    tops = out.top_logprobs[0]
    assert tops is not None and [t for t, _ in tops] == lp.topk(3).indices.tolist()
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    torch.set_num_threads(2)
    data: Path = tmp_path_factory.mktemp("data")
    lm = load_model("tiny-llama", data_dir=data, dtype="float32")
    return ModelRunner(lm.model, EngineConfig(num_kv_blocks=64, block_size=8))


def _req(rid: str, seed: int | None, prompt: list[int]) -> Request:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=8, logprobs=2)
    return Request(rid, prompt, params)


def test_runner_seeded_requests_reproduce_across_batches(runner: ModelRunner) -> None:
    alone = run_requests(runner, [_req("a", 123, [0, 5, 6, 7])])[0]
    mixed = run_requests(
        runner, [_req("x", None, [0, 9, 9]), _req("b", 123, [0, 5, 6, 7]), _req("y", 5, [0, 1])]
    )[1]
    assert alone.output_token_ids == mixed.output_token_ids


def test_runner_returns_logprobs(runner: ModelRunner) -> None:
    from sluice.engine.core.outputs import ScheduledRequest, SchedulerOutput

    r = _req("lp", 1, [0, 5, 6])
    out = runner.execute(SchedulerOutput([ScheduledRequest(r, 0, 3, [1], True)], 3))
    (tok,) = out.sampled
    assert tok.logprob is not None and tok.logprob <= 0.0
    assert tok.top_logprobs is not None and len(tok.top_logprobs) == 2
