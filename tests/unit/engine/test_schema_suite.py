"""Every schema of the structured-outputs suite (`benchmarks.schemas`), generated greedily
under its own constraint by the engine (all of them as one batch on one EngineCore), on the
random-weight tiny-llama preset and on the default model, SmolLM2-135M-Instruct (slow).

An output cut at max_tokens counts as invalid, and none is: both models loop greedily where
a schema bounds nothing (a free string, a number's digits, a recursion), and the engine
winds such a request up (`engine.logits`), so 100 % of the outputs parse and validate
(formats checked). Also: a request resumed after k tokens, as a failed-over worker
resubmits it, continues the straight output exactly.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from benchmarks.schemas import SCHEMAS, SchemaCase, by_name
from sluice.engine.backends.base import EngineRequest
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore, tokenizer_detokenizers
from sluice.engine.loader import LoadedModel, load_model
from sluice.engine.model_files import SMOLLM2
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import Constraint, SamplingParams
from sluice.engine.structured import GrammarCompiler
from tests.unit.engine.invariants import drive, outcomes

MAX_TOKENS = 512
Result = tuple[list[int], str, str | None]

# RFC 3339, as JSON Schema defines "date-time" and "time" (an offset is required); the
# default FormatChecker skips both unless rfc3339-validator is installed, which it is not
_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
_TIME_RE = re.compile(_TIME)
_DATE_TIME_RE = re.compile(r"(\d{4}-\d{2}-\d{2})[Tt ]" + _TIME)


def _time_ok(h: str, m: str, s: str, oh: str | None, om: str | None) -> bool:
    offset_ok = oh is None or (int(oh) < 24 and int(om or 0) < 60)
    return int(h) < 24 and int(m) < 60 and int(s) <= 60 and offset_ok


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()  # date, email, uuid, … (all it knows)

    @checker.checks("time")
    def _time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        m = _TIME_RE.fullmatch(value)
        return bool(m) and _time_ok(m[1], m[2], m[3], m[6], m[7])

    @checker.checks("date-time")
    def _date_time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        m = _DATE_TIME_RE.fullmatch(value)
        if not m:
            return False
        try:
            dt.date.fromisoformat(m[1])
        except ValueError:
            return False
        return _time_ok(m[2], m[3], m[4], m[7], m[8])

    return checker


FORMAT_CHECKER = _format_checker()


def _formats(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        own = {schema["format"]} if isinstance(schema.get("format"), str) else set()
        return own.union(*(_formats(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_formats(v) for v in schema))
    return set()


def test_the_format_checker_checks_every_format_the_suite_uses() -> None:
    used = set().union(*(_formats(case.schema) for case in SCHEMAS))
    assert used and used <= set(FORMAT_CHECKER.checkers), used - set(FORMAT_CHECKER.checkers)
    assert FORMAT_CHECKER.conforms("2024-05-17T09:30:00Z", "date-time")
    assert not FORMAT_CHECKER.conforms("2024-02-30T09:30:00Z", "date-time")
    assert not FORMAT_CHECKER.conforms("2024-05-17T09:30:00", "date-time")  # no offset
    assert FORMAT_CHECKER.conforms("23:59:60+01:00", "time")
    assert not FORMAT_CHECKER.conforms("24:00:00Z", "time")
    for case in SCHEMAS:
        _validator(case).validate(case.example)


def _validator(case: SchemaCase) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(case.schema, jsonschema.Draft202012Validator)
    return cls(case.schema, format_checker=FORMAT_CHECKER)


def make_core(loaded: LoadedModel, prompts: list[list[int]]) -> EngineCore:
    block_size = 16
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = len(prompts) * -(-longest // block_size) + 8  # all at once: no preemption
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=blocks,
        max_model_len=longest + block_size,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        dtype="float32",
    )
    grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)
    runner = ModelRunner(loaded.model, config, grammars=grammars)
    return EngineCore(
        config,
        runner,
        eos_token_ids=loaded.eos_token_ids,
        detokenizers=tokenizer_detokenizers(loaded.tokenizer),
    )


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, Result]:
    return outcomes(drive(core, requests))


def constraint(case: SchemaCase) -> Constraint:
    return Constraint("json_schema", json.dumps(case.schema))


def generate_suite(loaded: LoadedModel, prompts: dict[str, list[int]]) -> dict[str, Result]:
    core = make_core(loaded, list(prompts.values()))
    params = {
        case.name: SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, constraint=constraint(case)
        )
        for case in SCHEMAS
    }
    requests = [EngineRequest(name, prompt, params[name]) for name, prompt in prompts.items()]
    return run(core, requests)


def failures(results: dict[str, Result]) -> dict[str, str]:
    """name → why its output is not a valid instance (empty: all valid)."""
    bad: dict[str, str] = {}
    for case in SCHEMAS:
        tokens, text, reason = results[case.name]
        if reason != "stop":
            bad[case.name] = f"finish_reason {reason} after {len(tokens)} tokens: {text[-160:]!r}"
            continue
        try:
            instance = json.loads(text)
        except ValueError as exc:
            bad[case.name] = f"not JSON ({exc}): {text[:300]!r}"
            continue
        errors = [e.message for e in _validator(case).iter_errors(instance)]
        if errors:
            bad[case.name] = f"invalid ({'; '.join(errors)[:300]}): {text[:300]!r}"
    return bad


def _report(results: dict[str, Result]) -> str:
    lengths = sorted(len(tokens) for tokens, _, _ in results.values())
    median = lengths[len(lengths) // 2]
    return f"{len(results)} outputs, tokens min {lengths[0]} median {median} max {lengths[-1]}"


# -- tiny-llama: random weights, the hardest test of the engine's wind-up ------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("tiny-llama", data_dir=tmp_path_factory.mktemp("data"), dtype="float32")


@pytest.fixture(scope="module")
def tiny_prompts(tiny: LoadedModel) -> dict[str, list[int]]:
    return {case.name: tiny.tokenizer.encode(case.name.replace("_", " ")) for case in SCHEMAS}


@pytest.fixture(scope="module")
def tiny_suite(tiny: LoadedModel, tiny_prompts: dict[str, list[int]]) -> dict[str, Result]:
    results = generate_suite(tiny, tiny_prompts)
    print(_report(results))
    return results


def test_every_schema_validates_on_tiny_llama(tiny_suite: dict[str, Result]) -> None:
    bad = failures(tiny_suite)
    assert not bad, _listing(bad)


def _listing(bad: dict[str, str]) -> str:
    return f"{len(bad)}/{len(SCHEMAS)} invalid:\n" + "\n".join(
        f"{name}: {why}" for name, why in bad.items()
    )


# -- a failover mid-stream: the resumed attempt goes on exactly where the first one stopped --

RESUMED_SCHEMAS = [
    "address",
    "iso_dates",
    "uuid_record",
    "classification_multi",
    "shipping_and_billing_refs",
    "bank_transaction",
    "payment_method_oneof",  # loops inside an email and winds up: the resume does the same
    "tree_node_recursive",
]


def _cut_points(n: int) -> list[int]:
    return sorted({k for k in (1, 2, 7, n // 2, n - 2, n - 1) if 1 <= k < n})


def test_a_resumed_request_continues_the_straight_output_exactly(
    tiny: LoadedModel, tiny_prompts: dict[str, list[int]], tiny_suite: dict[str, Result]
) -> None:
    """As the worker resubmits a failed-over request: prompt + the k tokens published,
    max_tokens less k, num_resumed_tokens=k (the grammar replays them)."""
    requests, expected = [], {}
    for name in RESUMED_SCHEMAS:
        tokens, text, reason = tiny_suite[name]
        for k in _cut_points(len(tokens)):
            rid = f"{name}@{k}"
            params = SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS - k, constraint=constraint(by_name(name))
            )
            requests.append(EngineRequest(rid, tiny_prompts[name] + tokens[:k], params,
                                          num_resumed_tokens=k))  # fmt: skip
            expected[rid] = (tokens, text, reason, k)
    assert all(tiny_suite[n][2] == "stop" for n in RESUMED_SCHEMAS)
    prompts = [r.prompt_token_ids for r in requests]
    results = run(make_core(tiny, prompts), requests)
    diverged = []
    for rid, (tokens, text, reason, k) in expected.items():
        rest, rest_text, rest_reason = results[rid]
        if tokens[:k] + rest != tokens or rest_reason != reason or not text.endswith(rest_text):
            diverged.append(
                f"{rid}: straight {tokens[k : k + 8]}… {reason}, resumed {rest[:8]}… {rest_reason}"
            )
    assert not diverged, "\n".join(diverged)


# -- the default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(gguf: Path) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model(SMOLLM2, dtype="float32")


@pytest.fixture(scope="module")
def smollm2_suite(smollm2: LoadedModel) -> dict[str, Result]:
    def chat(name: str) -> list[int]:
        message = {"role": "user", "content": f"Return a JSON object for: {name}"}
        ids = smollm2.tokenizer.apply_chat_template([message], tokenize=True)
        assert isinstance(ids, list)
        return ids

    results = generate_suite(smollm2, {case.name: chat(case.name) for case in SCHEMAS})
    print(_report(results))
    return results


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 65 requests of up to 512 tokens, batched, on 2 CPU cores
def test_every_schema_validates_on_smollm2(smollm2_suite: dict[str, Result]) -> None:
    bad = failures(smollm2_suite)
    assert not bad, _listing(bad)
