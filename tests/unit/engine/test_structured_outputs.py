"""Structured outputs, logit_bias, min_tokens and penalties through the whole engine on
the tiny-llama preset (random weights, greedy), and `engine.structured` on its own.

The constrained output parses, matches and ends 'stop' when the grammar is complete; a
preemption or a resume (replayed into a fresh matcher) changes nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from sluice.engine.backends.base import EngineRequest, RequestRejectedError
from sluice.engine.config import EngineConfig
from sluice.engine.core.request import Request
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.logits import LogitsProcessor
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import Constraint, SamplingParams
from sluice.engine.structured import (
    GrammarCompiler,
    StructuredOutputError,
    grammar_for,
    tightened,
)
from tests.unit.engine.invariants import drive, outcomes

PROMPTS = ["Hello, world. How are you today?", "the quick brown fox", "Engines batch requests"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no way", 'say "hi"', "naïve"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("tiny-llama", data_dir=tmp_path_factory.mktemp("data"), dtype="float32")


@pytest.fixture(scope="module")
def grammars(loaded: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in PROMPTS]


def make_core(loaded: LoadedModel, grammars: GrammarCompiler, **overrides: Any) -> EngineCore:
    overrides.setdefault("num_kv_blocks", 128)
    overrides.setdefault("max_model_len", 256)
    overrides.setdefault("max_num_batched_tokens", 128)
    config = EngineConfig(block_size=4, dtype="float32", **overrides)
    runner = ModelRunner(loaded.model, config, grammars=grammars)
    return EngineCore(
        config,
        runner,
        eos_token_ids=loaded.eos_token_ids,
        detokenizers=tokenizer_detokenizers(loaded.tokenizer),
    )


Result = tuple[list[int], str, str | None]


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, Result]:
    return outcomes(drive(core, requests, max_steps=2000))


def greedy(constraint: Constraint | None = None, **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 80)
    return SamplingParams(temperature=0.0, constraint=constraint, **kw)


CONSTRAINTS = {
    "schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "object": Constraint("json_object"),
    "choice": Constraint("choice", json.dumps(CHOICES)),
    "regex": Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"),
    "grammar": Constraint("grammar", 'start: "A" /[a-z]{3}/ "."'),
}


@pytest.fixture(scope="module")
def constrained(
    loaded: LoadedModel, grammars: GrammarCompiler, prompts: list[list[int]]
) -> dict[str, Result]:
    """Every constraint on every prompt, in one batch."""
    core = make_core(loaded, grammars)
    requests = [
        EngineRequest(f"{name}/{i}", prompt, greedy(c))
        for name, c in CONSTRAINTS.items()
        for i, prompt in enumerate(prompts)
    ]
    return run(core, requests)


def outputs(constrained: dict[str, Result], name: str) -> list[Result]:
    return [v for k, v in constrained.items() if k.split("/")[0] == name]


def test_json_schema_output_validates(constrained: dict[str, Result]) -> None:
    for _, text, reason in outputs(constrained, "schema"):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_is_an_object(constrained: dict[str, Result]) -> None:
    # random weights may never close a key: what ends parses, the rest is an object's start
    results = outputs(constrained, "object")
    for _, text, reason in results:
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
    assert any(reason == "stop" for _, _, reason in results)


def test_choice_is_one_of_the_choices(constrained: dict[str, Result]) -> None:
    for _, text, reason in outputs(constrained, "choice"):
        assert reason == "stop" and text in CHOICES


def test_regex_and_grammar_stop_when_complete(
    constrained: dict[str, Result], loaded: LoadedModel
) -> None:
    for tokens, text, reason in outputs(constrained, "regex"):
        assert reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)
        assert loaded.tokenizer.decode(tokens) == text  # nothing past the grammar's end
    for _, text, reason in outputs(constrained, "grammar"):
        assert reason == "stop" and re.fullmatch(r"A[a-z]{3}\.", text)


def test_preemption_keeps_the_matcher(
    loaded: LoadedModel,
    grammars: GrammarCompiler,
    prompts: list[list[int]],
    constrained: dict[str, Result],
) -> None:
    baseline = {k: v for k, v in constrained.items() if k.startswith("schema/")}
    needed = max(-(-(len(p) + len(baseline[f"schema/{i}"][0])) // 4) for i, p in enumerate(prompts))
    core = make_core(loaded, grammars, num_kv_blocks=needed + 3)
    c = CONSTRAINTS["schema"]
    result = run(core, [EngineRequest(f"schema/{i}", p, greedy(c)) for i, p in enumerate(prompts)])
    assert core.scheduler.num_preemptions > 0
    assert result == baseline


@pytest.mark.parametrize("name", ["schema", "grammar"])
def test_resume_replays_into_a_fresh_matcher(
    name: str,
    loaded: LoadedModel,
    grammars: GrammarCompiler,
    prompts: list[list[int]],
    constrained: dict[str, Result],
) -> None:
    tokens, text, _ = constrained[f"{name}/0"]
    k = len(tokens) // 2
    request = EngineRequest(
        "resumed",
        prompts[0] + tokens[:k],
        greedy(CONSTRAINTS[name], max_tokens=80 - k),
        num_resumed_tokens=k,
    )
    rest, rest_text, reason = run(make_core(loaded, grammars), [request])["resumed"]
    assert tokens[:k] + rest == tokens and reason == "stop"
    assert text.endswith(rest_text)


def test_after_starts_the_constraint_once_the_text_is_there(
    loaded: LoadedModel, grammars: GrammarCompiler, prompts: list[list[int]]
) -> None:
    core = make_core(loaded, grammars)
    free, _, _ = run(core, [EngineRequest("free", prompts[1], greedy(max_tokens=12))])["free"]
    # the first printable ASCII character of the free output, and the token that has it
    seen = b""
    for k in range(1, len(free) + 1):
        seen += grammars.ll_tokenizer.decode_bytes([free[k - 1]])
        ascii_chars = [chr(b) for b in seen if 33 <= b < 127]
        if ascii_chars:
            after = ascii_chars[0]
            break
    else:
        pytest.skip("the model wrote no ASCII")
    c = Constraint("choice", json.dumps(CHOICES), after=after)
    tokens, _, reason = run(core, [EngineRequest("after", prompts[1], greedy(c))])["after"]
    assert tokens[:k] == free[:k] and reason == "stop"
    assert loaded.tokenizer.decode(tokens[k:]) in CHOICES


def test_bad_constraints_fail_cleanly(
    loaded: LoadedModel, grammars: GrammarCompiler, prompts: list[list[int]]
) -> None:
    for bad in (
        Constraint("regex", "a("),
        Constraint("grammar", "start: nothing_defined"),
        Constraint("json_schema", "{not json"),
        Constraint("choice", '["a", 3]'),
    ):
        with pytest.raises(StructuredOutputError):
            grammars.check(bad)
    core = make_core(loaded, grammars)
    # known bad: refused at once; a new one fails in the engine alone, with 'error'
    with pytest.raises(RequestRejectedError):
        core.add_request(EngineRequest("bad", prompts[0], greedy(Constraint("regex", "a("))))
    fresh = Constraint("regex", "b(")
    out = run(
        core,
        [
            EngineRequest("bad2", prompts[0], greedy(fresh)),
            EngineRequest("good", prompts[1], greedy(CONSTRAINTS["regex"])),
        ],
    )
    assert out["bad2"][2] == "error" and out["good"][2] == "stop"


def test_choice_escapes_quotes_and_unicode(grammars: GrammarCompiler) -> None:
    grammar = grammar_for(Constraint("choice", json.dumps(['a "b" \\ c', "ü"])))
    assert "start:" in grammar
    grammars.check(Constraint("choice", json.dumps(['a "b" \\ c', "ü"])))


def test_logit_bias_forces_a_token(
    loaded: LoadedModel, grammars: GrammarCompiler, prompts: list[list[int]]
) -> None:
    core = make_core(loaded, grammars)
    out = run(core, [EngineRequest("b", prompts[0], greedy(max_tokens=5, logit_bias={77: 100.0}))])
    assert out["b"][0] == [77] * 5


def test_min_tokens_holds_eos_back(
    loaded: LoadedModel, grammars: GrammarCompiler, prompts: list[list[int]]
) -> None:
    eos = loaded.eos_token_ids[0]
    core = make_core(loaded, grammars)
    params = greedy(max_tokens=20, min_tokens=5, logit_bias={eos: 60.0})
    tokens, _, reason = run(core, [EngineRequest("m", prompts[0], params)])["m"]
    assert len(tokens) == 6 and tokens[-1] == eos and eos not in tokens[:-1]
    assert reason == "stop"


def test_penalties_follow_the_reference(
    loaded: LoadedModel,
    grammars: GrammarCompiler,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    core = make_core(loaded, grammars)
    plain = run(core, [EngineRequest("p", prompts[1], greedy(max_tokens=24))])["p"][0]
    runner = core.runner
    assert isinstance(runner, ModelRunner)
    seen: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
    sample = runner.sampler.sample

    def spy(logits: torch.Tensor, params: Any, gens: Any, raw: Any = None) -> Any:
        request = core.scheduler.requests["q"]
        seen.append((logits.clone(), raw.clone(), list(request.output_token_ids)))
        return sample(logits, params, gens, raw)

    monkeypatch.setattr(runner.sampler, "sample", spy)
    params = greedy(max_tokens=24, logprobs=0, **penalties)
    tokens = run(core, [EngineRequest("q", prompts[1], params)])["q"][0]
    assert tokens != plain
    for step, (processed, raw, output) in enumerate(seen):
        request = Request("ref", prompts[1], params)
        request.output_token_ids = output
        expected = raw.clone()
        LogitsProcessor().apply(expected, [0], [request], {})
        torch.testing.assert_close(processed, expected)
        assert tokens[step] == int(expected.argmax())


def test_schemas_are_tightened_so_a_weak_model_cannot_run_on(
    grammars: GrammarCompiler,
) -> None:
    """A weak model's greedy loops ("1222222...", key after made-up key) cannot run to
    max_tokens; what the grammar admits still validates against the schema as written."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "number"}, "i": {"type": ["integer", "null"]}},
        "enum": [{"type": "integer"}],
        "$defs": {"Open": {"type": "object", "additionalProperties": True, "properties": {}}},
        "allOf": [{"properties": {"a": {"type": "string"}}}],
    }
    t = tightened(schema)
    assert t["properties"]["n"]["maximum"] == 2**53 - 1
    assert t["properties"]["i"]["minimum"] == -(2**53 - 1)
    assert t["enum"] == schema["enum"]  # data, not a schema
    assert t["$defs"]["Open"]["additionalProperties"] is True
    assert "additionalProperties" not in t  # it has allOf: its members hold properties too
    assert "additionalProperties" not in t["allOf"][0]
    assert tightened({"type": "integer", "minimum": 0}) == {
        "type": "integer",
        "minimum": 0,
        "maximum": 2**53 - 1,
    }
    closed = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert tightened(closed)["additionalProperties"] is False
    tok = grammars.tokenizer
    for constraint, text in (
        (Constraint("json_schema", json.dumps({"type": "integer"})), "1" + "2" * 40),
        (Constraint("grammar", 'start: "n=" %json{"type": "integer"}'), "n=1" + "2" * 40),
        (Constraint("json_schema", json.dumps(closed)), '{"a":"x","b":1}'),
    ):
        matcher = grammars.matcher(constraint)
        for token_id in tok.encode(text, add_special_tokens=False):
            matcher.consume(token_id)
        assert matcher.error is not None, constraint  # refused past the bound / extra key
