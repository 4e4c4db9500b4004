"""`engine_request` maps the sampling API's penalties, logit_bias, prompt_logprobs and
structured outputs to the engine's `SamplingParams`, resumed attempts included."""

from __future__ import annotations

import pytest

from sluice.bus.base import TopicPartition
from sluice.bus.messages import GenerateRequest, SamplingSpec, StructuredSpec
from sluice.consumers.work_item import WorkItem
from sluice.consumers.worker_requests import engine_request
from sluice.engine.sampling import Constraint, SamplingParamsError


def item(sampling: SamplingSpec, resumed: list[int] | None = None) -> WorkItem:
    request = GenerateRequest(
        request_id="r1",
        tenant_id="t",
        model="m",
        prompt_token_ids=[5, 6, 7],
        sampling=sampling,
        reply_to="gw",
        created_ms=0,
    )
    work = WorkItem(request, TopicPartition("topic", 0), 0, None, 0)
    work.resumed_token_ids = list(resumed or [])
    return work


def test_new_fields_map_to_sampling_params() -> None:
    spec = SamplingSpec(
        max_tokens=10,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias={3: 5.0, 9: -100.0},
        prompt_logprobs=2,
        structured=StructuredSpec(kind="regex", value="[ab]+", after="</think>"),
    )
    params = engine_request(item(spec)).sampling_params
    assert params.frequency_penalty == 0.5
    assert params.presence_penalty == -0.25
    assert params.repetition_penalty == 1.2
    assert params.logit_bias == {3: 5.0, 9: -100.0}
    assert params.prompt_logprobs == 2
    assert params.constraint == Constraint("regex", "[ab]+", "</think>")
    assert params.processes_logits


def test_defaults_leave_the_fast_path() -> None:
    params = engine_request(item(SamplingSpec())).sampling_params
    assert params.constraint is None and params.logit_bias == {}
    assert not params.processes_logits


def test_resumed_attempt_counts_its_tokens_as_output_and_skips_prompt_logprobs() -> None:
    spec = SamplingSpec(
        max_tokens=10,
        min_tokens=4,
        prompt_logprobs=1,
        structured=StructuredSpec(kind="json_object"),
    )
    request = engine_request(item(spec, resumed=[11, 12]))
    assert request.prompt_token_ids == [5, 6, 7, 11, 12]
    assert request.num_resumed_tokens == 2
    params = request.sampling_params
    assert (params.max_tokens, params.min_tokens) == (8, 2)
    assert params.prompt_logprobs is None  # the first attempt echoed the prompt
    assert params.constraint == Constraint("json_object")


@pytest.mark.parametrize(
    "field, value",
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("logit_bias", {1: 101.0}),
        ("prompt_logprobs", 21),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        engine_request(item(SamplingSpec(**{field: value})))
