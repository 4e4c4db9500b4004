"""Who bills a request's prompt: the attempt that ends it, once, whatever ran before."""

from __future__ import annotations

from sluice.bus.base import TopicPartition
from sluice.consumers.engine_outputs import superseded_usage
from sluice.consumers.progress import AttemptStart
from sluice.consumers.work_item import WorkItem
from tests.unit.consumers.engine_harness import make_request


def _item(**fields: object) -> WorkItem:
    request = make_request("r", prompt=[1, 2, 3, 4, 5], max_tokens=8, **fields)
    item = WorkItem(request, TopicPartition("t", 0), 0, None, 0)
    item.start()
    item.begin(AttemptStart(2))
    return item


def test_an_attempt_superseded_midway_bills_what_it_published_and_no_prompt() -> None:
    usage = superseded_usage(_item(), 1, 3)
    assert (usage.attempt, usage.prompt_tokens, usage.completion_tokens) == (1, 0, 3)
    assert usage.estimated and usage.finish_reason == "error"


def test_an_attempt_that_ended_the_request_before_its_usage_went_out_bills_the_prompt() -> None:
    usage = superseded_usage(_item(), 1, 8, ended=True)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (5, 0, 8)
    assert usage.estimated and usage.finish_reason == "length"
    later_choice = superseded_usage(_item(bill_prompt=False), 1, 2, ended=True)
    assert (later_choice.prompt_tokens, later_choice.finish_reason) == (0, "stop")
