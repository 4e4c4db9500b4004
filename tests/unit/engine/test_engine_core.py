"""EngineCore over the fake runner: deltas, stop handling, terminal deltas, equivalences."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.backends.base import EngineDelta, EngineRequest
from sluice.engine.config import EngineConfig
from sluice.engine.core.request import Request
from sluice.engine.engine_core import Detokenizer, EngineCore
from sluice.engine.sampling import SamplingParams
from sluice.engine.tokenizer import IncrementalDetokenizer
from tests.unit.engine.fakes import FakeRunner, FakeTokenizer, reference_tokens, token_text
from tests.unit.engine.invariants import check_all_returned


def detokenizers(request: Request) -> Detokenizer:
    return IncrementalDetokenizer(
        FakeTokenizer(),  # type: ignore[arg-type]
        request.prompt_token_ids,
        request.sampling_params.stop,
    )


def make_core(num_kv_blocks: int = 64, eos: tuple[int, ...] = (), **overrides: Any) -> EngineCore:
    overrides.setdefault("max_num_batched_tokens", 64)
    overrides.setdefault("max_model_len", 64)
    config = EngineConfig(block_size=4, num_kv_blocks=num_kv_blocks, **overrides)
    runner = FakeRunner(num_kv_blocks, 4)
    return EngineCore(config, runner, eos_token_ids=eos, detokenizers=detokenizers, hash_seed=0)


def greedy(max_tokens: int = 6, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def run(core: EngineCore, max_steps: int = 500) -> dict[str, list[EngineDelta]]:
    out: dict[str, list[EngineDelta]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for delta in core.step():
            out.setdefault(delta.request_id, []).append(delta)
    assert not core.has_unfinished()
    for deltas in out.values():
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    return out


def tokens(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text(deltas: list[EngineDelta]) -> str:
    return "".join(d.text for d in deltas)


PROMPT = list(range(1, 19))


def test_deltas_carry_tokens_text_and_usage_on_the_terminal_one() -> None:
    core = make_core()
    core.add_request(EngineRequest("a", PROMPT, greedy(6)))
    out = run(core)["a"]
    expected = reference_tokens(PROMPT, 6)
    assert tokens(out) == expected
    assert text(out) == "".join(token_text(t) for t in expected)
    last = out[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == (
        "length",
        18,
        6,
    )
    assert last.num_cached_tokens == 0
    assert all(d.num_output_tokens is None for d in out[:-1])


def test_first_tokens_are_counted_once_per_request() -> None:
    core = make_core()
    core.add_request(EngineRequest("a", PROMPT, greedy(6)))
    core.add_request(EngineRequest("b", PROMPT[:5], greedy(3)))
    first = core.step()  # both prefill whole in one step
    assert {d.request_id for d in first if d.token_ids} == {"a", "b"}
    assert core.num_first_tokens == 2
    run(core)
    assert core.num_first_tokens == 2 and core.num_generated_tokens == 9


def test_stop_string_is_held_back_and_never_emitted() -> None:
    expected_text = "".join(token_text(t) for t in reference_tokens(PROMPT, 12))
    stop = expected_text[5:7]
    cut = expected_text.find(stop)
    core = make_core()
    core.add_request(EngineRequest("a", PROMPT, greedy(12, stop=[stop])))
    out = run(core)["a"]
    assert text(out) == expected_text[:cut]
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason == stop
    assert out[-1].num_output_tokens == cut + 2
    check_all_returned(core.scheduler)


def test_eos_ends_the_request_with_its_token_but_not_its_text() -> None:
    expected = reference_tokens(PROMPT, 8)
    core = make_core(eos=(expected[3],))
    core.add_request(EngineRequest("a", PROMPT, greedy(8)))
    out = run(core)["a"]
    first = expected.index(expected[3])
    assert tokens(out) == expected[: first + 1]
    assert text(out) == "".join(token_text(t) for t in expected[:first])
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason is None


def test_stop_token_id_is_reported_as_stop_reason() -> None:
    expected = reference_tokens(PROMPT, 8)
    core = make_core()
    core.add_request(EngineRequest("a", PROMPT, greedy(8, stop_token_ids=[expected[2]])))
    out = run(core)["a"]
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason == expected[2]


def test_abort_while_waiting_and_while_running_gives_one_terminal_each() -> None:
    core = make_core(max_num_seqs=1)
    core.add_request(EngineRequest("run", PROMPT, greedy(20)))
    core.add_request(EngineRequest("wait", PROMPT, greedy(20)))
    first = core.step()
    assert [d.request_id for d in first] == ["run"]
    assert core.abort_request("wait") and core.abort_request("run")
    assert not core.abort_request("run")
    out = run(core)
    assert out["wait"][-1].finish_reason == "abort"
    assert out["wait"][-1].num_output_tokens == 0
    assert out["run"][-1].finish_reason == "abort" and out["run"][-1].num_output_tokens == 1
    check_all_returned(core.scheduler)


def test_deadline_gives_a_deadline_terminal() -> None:
    core = make_core()
    core.add_request(EngineRequest("late", PROMPT, greedy(20), deadline=0.0))
    out = run(core)
    assert out["late"] == [
        EngineDelta(
            "late",
            finish_reason="deadline",
            num_prompt_tokens=18,
            num_cached_tokens=0,
            num_output_tokens=0,
        )
    ]


def test_second_request_reports_cached_tokens() -> None:
    core = make_core()
    core.add_request(EngineRequest("a", PROMPT, greedy(4)))
    run(core)
    core.add_request(EngineRequest("b", PROMPT, greedy(4)))
    out = run(core)["b"]
    assert out[-1].num_cached_tokens == 16
    assert tokens(out) == reference_tokens(PROMPT, 4)


PROMPTS = [PROMPT, PROMPT[:9], [7] * 13, PROMPT[:5] + [9] * 10, [3, 1]]


def _outputs(**overrides: Any) -> dict[str, tuple[list[int], str, str | None]]:
    num_kv_blocks = overrides.pop("num_kv_blocks", 64)
    core = make_core(num_kv_blocks=num_kv_blocks, **overrides)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"r{i}", prompt, greedy(10)))
    out = run(core)
    check_all_returned(core.scheduler)
    return {rid: (tokens(d), text(d), d[-1].finish_reason) for rid, d in out.items()}


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_num_batched_tokens": 5},
        {"max_num_batched_tokens": 64, "enable_chunked_prefill": False},
        {"enable_prefix_caching": False},
        {"num_kv_blocks": 9},  # forces preemption
        {"max_num_seqs": 1},  # one at a time
        {"scheduling_policy": "priority", "num_kv_blocks": 9, "max_num_batched_tokens": 7},
    ],
)
def test_outputs_do_not_depend_on_scheduling(overrides: dict[str, Any]) -> None:
    assert _outputs(**overrides) == _outputs()


def test_forced_preemption_happens_in_the_small_cache() -> None:
    core = make_core(num_kv_blocks=9)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"r{i}", prompt, greedy(10)))
    run(core)
    assert core.stats().num_preemptions > 0
