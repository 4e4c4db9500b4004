"""Structured outputs, sampling extras and tools at the gateway: what reaches the engine
(`SamplingSpec`), the 400s, the default tool rendering on SmolLM2's real template, and the
grammar that forces a call (checked with llguidance on SmolLM2's vocabulary)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from fastapi.testclient import TestClient

from sluice.api.app import create_app
from sluice.api.tools import call_grammar, chat_tools, render_messages, write_calls
from sluice.bus.memory import MemoryEventBus
from sluice.engine.model_files import load_tokenizer, smollm2_gguf
from sluice.engine.sampling import Constraint
from sluice.engine.structured import GrammarCompiler, grammar_for
from sluice.settings import GatewaySettings
from tests.unit.api.fakes import FakeEngineWorker, served_model

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "adds",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    },
]


@pytest.fixture
def app(settings: GatewaySettings, memory_bus: MemoryEventBus, engine: FakeEngineWorker) -> Any:
    # room for the tools' system block (the fake tokenizer is a token per byte)
    return create_app(settings, memory_bus, [served_model("tiny", max_model_len=8192)])


def _sent(client: TestClient, engine: FakeEngineWorker, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return engine.requests[-1][1].sampling


def _error(r: Any, param: str, code: str = "invalid_value") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)


# -- sampling --------------------------------------------------------------------------------
def test_penalties_and_logit_bias_reach_the_engine(
    client: TestClient, engine: FakeEngineWorker
) -> None:
    extra = {
        "frequency_penalty": 0.5,
        "presence_penalty": -1.0,
        "repetition_penalty": 1.2,
        "logit_bias": {"65": 5, "66": -100},
    }
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": "tiny", "prompt": "x"}),
    ):
        spec = _sent(client, engine, path, {**body, **extra})
        assert (spec.frequency_penalty, spec.presence_penalty) == (0.5, -1.0)
        assert spec.repetition_penalty == 1.2
        assert spec.logit_bias == {65: 5.0, 66: -100.0}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"256": 1}}, "logit_bias"),  # the fake tokenizer's vocabulary is 256
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_penalties_and_bias_are_400s(
    client: TestClient, extra: dict[str, Any], param: str
) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_echo_puts_the_prompt_first(client: TestClient, engine: FakeEngineWorker) -> None:
    body = {"model": "tiny", "prompt": ["ab", "cd"], "echo": True, "max_tokens": 5}
    r = client.post("/v1/completions", json=body)
    assert [c["text"] for c in r.json()["choices"]] == ["abHello", "cdHello"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        texts: dict[int, str] = {}
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "abHello", 1: "cdHello"}


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(
    client: TestClient, engine: FakeEngineWorker
) -> None:
    body = {"model": "tiny", "prompt": ["ab", "cd"], "echo": True, "max_tokens": 2, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert [q.sampling.prompt_logprobs for q in engine.wait_for_requests(2)] == [1, 1]
    first = r.json()["choices"][0]
    assert first["text"] == "abHe"
    assert first["logprobs"] == {
        "tokens": ["a", "b", "H", "e"],
        "token_logprobs": [None, -1.0, -0.5, -0.5],
        "top_logprobs": [None, {"b": -1.0}, {"H": -0.5}, {"e": -0.5}],
        "text_offset": [0, 1, 2, 3],
    }
    assert r.json()["choices"][1]["logprobs"]["tokens"][:2] == ["c", "d"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    firsts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            firsts.setdefault(c["index"], c)
    assert firsts[0]["text"] == "ab" and firsts[1]["text"] == "cd"
    assert firsts[0]["logprobs"]["tokens"] == ["a", "b"]
    assert firsts[0]["logprobs"]["token_logprobs"] == [None, -1.0]
    # vLLM's own field: per choice, None first, {token id: logprob, rank, text}
    r = client.post("/v1/completions", json={**body, "echo": False, "prompt_logprobs": 1})
    assert r.json()["choices"][0]["prompt_logprobs"] == [
        None,
        {str(ord("b")): {"logprob": -1.0, "rank": 1, "decoded_token": "b"}},
    ]


# -- constraints -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA},
                }
            },
            "json_schema",
            SCHEMA,
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_grammar": 'start: "x"+'}, "grammar", 'start: "x"+'),
    ],
)
def test_constraints_become_one_structured_spec(
    client: TestClient, engine: FakeEngineWorker, extra: dict[str, Any], kind: str, value: Any
) -> None:
    spec = _sent(client, engine, "/v1/chat/completions", {**CHAT, **extra}).structured
    assert spec.kind == kind and spec.after is None
    assert (json.loads(spec.value) if kind in ("json_schema", "choice") else spec.value) == value


def test_text_format_json_schema_on_responses(client: TestClient, engine: FakeEngineWorker) -> None:
    fmt = {"type": "json_schema", "name": "c", "schema": SCHEMA, "strict": True}
    body = {"model": "tiny", "input": "Hi", "text": {"format": fmt}}
    spec = _sent(client, engine, "/v1/responses", body).structured
    assert spec.kind == "json_schema" and json.loads(spec.value) == SCHEMA


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": {"type": "bogus"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    client: TestClient, extra: dict[str, Any], param: str
) -> None:
    _error(client.post("/v1/chat/completions", json={**CHAT, **extra}), param)


# -- tools over HTTP ---------------------------------------------------------------------------
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_read_back_and_streamed_alike(
    client: TestClient, engine: FakeEngineWorker
) -> None:
    engine.reply = "Checking.\n" + CALL_TEXT
    body = {**CHAT, "tools": TOOLS, "max_tokens": 200}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Checking."
    [call] = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"

    content, args, finish, ids = "", "", None, []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta, finish = choice["delta"], choice["finish_reason"] or finish
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                assert tc["index"] == 0
                if "id" in tc:
                    ids.append(tc["id"])
                    assert tc["function"]["name"] == "get_weather" and tc["type"] == "function"
                args += tc["function"]["arguments"]
    assert (content, args, finish, len(ids)) == ("Checking.", '{"city": "Paris"}', "tool_calls", 1)


def test_tool_choice_named_forces_a_grammar(client: TestClient, engine: FakeEngineWorker) -> None:
    body = {
        **CHAT,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
    }
    spec = _sent(client, engine, "/v1/chat/completions", body).structured
    assert (
        spec.kind == "grammar" and '"const":"add"' in spec.value and "get_weather" not in spec.value
    )
    auto = _sent(client, engine, "/v1/chat/completions", {**CHAT, "tools": TOOLS})
    assert auto.structured is None
    prompt = bytes(engine.requests[-1][1].prompt_token_ids).decode()
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_are_400s(client: TestClient, extra: dict[str, Any], param: str) -> None:
    _error(client.post("/v1/chat/completions", json={**CHAT, **extra}), param)


def test_tool_history_is_accepted(client: TestClient, engine: FakeEngineWorker) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = bytes(engine.requests[-1][1].prompt_token_ids).decode()
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<user><tool_response>\n18C\n</tool_response>" in prompt


# -- SmolLM2's template and vocabulary ---------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer(smollm2_gguf())


def test_default_rendering_on_smollm2s_template(smollm2: Any) -> None:
    plan = chat_tools(TOOLS, "auto", None)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        {"role": "tool", "content": "sunny", "tool_call_id": "c2"},
    ]
    rendered, variables = render_messages(messages, plan, "hermes", smollm2.chat_template)
    assert variables == {}  # the template has no `tools` variable
    text = smollm2.apply_chat_template(rendered, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(TOOLS[0]) in text and "</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_a_template_with_tools_gets_them_as_transformers_passes_them() -> None:
    plan = chat_tools(TOOLS, "auto", None)
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 1}'}],
        }
    ]
    rendered, variables = render_messages(messages, plan, "hermes", "{{ tools }}")
    assert variables == {"tools": TOOLS}
    assert rendered[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_forced_call_grammar_accepts_calls_and_nothing_else(
    smollm2: Any, family: str, parallel: bool
) -> None:
    ll = GrammarCompiler(smollm2).ll_tokenizer
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        spec = call_grammar(chat_tools(TOOLS, choice, parallel), family)
        grammar = grammar_for(Constraint(spec.kind, spec.value))
        assert llguidance.LLMatcher.validate_grammar(grammar, ll) == ""
        # a named function is called once; `required` may hold several parallel calls
        calls = [("get_weather", '{"city":"Paris"}')] * (
            2 if parallel and choice == "required" else 1
        )
        good = llguidance.LLMatcher(ll, grammar)
        # compact JSON only (no blanks to spin in)
        assert good.consume_tokens(smollm2.encode(write_calls(family, calls, True), False))
        assert good.is_accepting()
        wrong = write_calls(family, [("get_weather", '{"town":1}')], True)
        for bad in (wrong, write_calls(family, calls), "Sure, let me"):
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
            ids = smollm2.encode(bad, False)
            assert not (matcher.consume_tokens(ids) and matcher.is_accepting())


# -- reasoning ---------------------------------------------------------------------------------
def test_think_blocks_become_reasoning(
    settings: GatewaySettings, memory_bus: MemoryEventBus, engine: FakeEngineWorker
) -> None:
    from sluice.api.served import ServedModel
    from tests.unit.api.conftest import API_KEY
    from tests.unit.api.fakes import ByteTokenizer

    model = ServedModel("tiny", 8192, ByteTokenizer(), reasoning_parser="think")
    app = create_app(settings, memory_bus, [model])
    engine.reply = "<think>hmm</think>\n\n{}"
    body = {**CHAT, "max_tokens": 100, "response_format": {"type": "json_object"}}
    with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        r = client.post("/v1/chat/completions", json=body).json()
        assert engine.requests[-1][1].sampling.structured.after == "</think>"
        message = r["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("hmm", "{}")
        assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        reasoning, content = "", ""
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=stream) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for c in chunk["choices"]:
                        reasoning += c["delta"].get("reasoning_content") or ""
                        content += c["delta"].get("content") or ""
                    usage = chunk["usage"] or {}
        assert (reasoning, content) == ("hmm", "{}")
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
        out = client.post("/v1/responses", json={"model": "tiny", "input": "Hi"}).json()
        assert [i["type"] for i in out["output"]] == ["reasoning", "message"]
        assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
        assert out["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}


def test_a_forced_call_takes_parameters_with_defs(smollm2: Any) -> None:
    """pydantic writes nested models as `#/$defs/...` references: inside the call's schema
    they must still resolve (lifted to its root, named per function)."""
    params = {
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/Address"}},
        "required": ["home"],
        "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    tools = [{"type": "function", "function": {"name": "save", "parameters": params}}]
    spec = call_grammar(chat_tools(tools, "required", True), "hermes")
    grammars = GrammarCompiler(smollm2)
    grammars.check(Constraint(spec.kind, spec.value))
    matcher = llguidance.LLMatcher(
        grammars.ll_tokenizer, grammar_for(Constraint(spec.kind, spec.value))
    )
    text = write_calls("hermes", [("save", '{"home":{"city":"Paris"}}')], True)
    assert matcher.consume_tokens(smollm2.encode(text, False)) and matcher.is_accepting()
