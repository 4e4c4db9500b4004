"""Structured outputs and tool calling through the official `openai` SDK, end to end.

The fast tests run the gateway on a loopback server with the fake engine answering a
scripted text (what a model would write), so they check the wire: `parse()` into a
pydantic model, a two-turn tool loop, streamed calls assembled by the SDK equal to the
non-streamed ones, Responses function calls. The slow one runs the real engine on
tiny-llama (random weights): only the engine's grammar makes its output valid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from sluice.api.app import create_app
from sluice.api.served import ServedModel
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker, ServerThread, served_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class City(BaseModel):
    name: str
    population: int


class SmallCity(BaseModel):
    """Bounded, so a random-weight model's constrained output ends within max_tokens."""

    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=999)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[ServerThread, FakeEngineWorker]]:
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=2, pools=("tiny",)).specs())
    worker = FakeEngineWorker(bus).start()
    app = create_app(gateway_settings(), bus, [served_model("tiny", max_model_len=8192)])
    with ServerThread(app) as server:
        yield server, worker
    worker.stop()
    bus.close()


@pytest.fixture
def engine(live: tuple[ServerThread, FakeEngineWorker]) -> Iterator[FakeEngineWorker]:
    worker = live[1]
    worker.requests[:] = []
    yield worker
    worker.reply = "Hello world"


@pytest.fixture
def client(live: tuple[ServerThread, FakeEngineWorker]) -> Iterator[openai.OpenAI]:
    base = f"{live[0].base_url}/v1"
    with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0) as c:
        yield c


def test_parse_into_a_pydantic_model(client: openai.OpenAI, engine: FakeEngineWorker) -> None:
    engine.reply = '{"name": "Paris", "population": 2100000}'
    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "A city?"}],
        response_format=City,
        max_tokens=100,
    )
    assert completion.choices[0].message.parsed == City(name="Paris", population=2100000)
    spec = engine.requests[-1][1].sampling.structured
    assert spec.kind == "json_schema"
    assert json.loads(spec.value)["properties"]["population"] == {
        "title": "Population",
        "type": "integer",
    }


def test_a_two_turn_tool_loop(client: openai.OpenAI, engine: FakeEngineWorker) -> None:
    engine.reply = CALL
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]  # type: ignore[type-arg]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert engine.requests[-1][1].sampling.structured.kind == "grammar"

    engine.reply = "It is 18C in Paris."
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18C"},
    ]
    second = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
    )
    assert second.choices[0].message.content == "It is 18C in Paris."
    assert second.choices[0].finish_reason == "stop"
    prompt = bytes(engine.requests[-1][1].prompt_token_ids).decode()
    assert "<tool_response>\n18C\n</tool_response>" in prompt


def test_streamed_calls_assemble_to_the_plain_answer(
    client: openai.OpenAI, engine: FakeEngineWorker
) -> None:
    engine.reply = "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris and Oslo?"}],
        tools=[WEATHER],
        temperature=0,
        seed=7,
        max_tokens=400,
    )
    plain = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_completion().choices[0]

    def calls(message: object) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[attr-defined]

    assert (
        calls(streamed.message)
        == calls(plain.message)
        == [
            ("get_weather", '{"city": "Paris"}'),
            ("get_weather", '{"city": "Oslo"}'),
        ]
    )
    assert streamed.message.content == plain.message.content == "Let me look."
    assert streamed.finish_reason == plain.finish_reason == "tool_calls"


def test_penalties_and_logit_bias_through_the_sdk(
    client: openai.OpenAI, engine: FakeEngineWorker
) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={"72": 10},
        extra_body={"repetition_penalty": 1.1},
    )
    assert reply.choices[0].message.content == "Hello world"
    spec = engine.requests[-1][1].sampling
    assert (spec.frequency_penalty, spec.presence_penalty, spec.repetition_penalty) == (
        0.5,
        0.25,
        1.1,
    )
    assert spec.logit_bias == {72: 10.0}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], logit_bias={"x": 1}
        )
    assert refused.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_responses_function_call_round_trip(
    client: openai.OpenAI, engine: FakeEngineWorker
) -> None:
    tool = {"type": "function", "name": "get_weather", **{
        k: v for k, v in WEATHER["function"].items() if k != "name"  # type: ignore[union-attr]
    }}  # fmt: skip
    engine.reply = CALL
    first = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",  # type: ignore[list-item]
    )
    [item] = first.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"}

    with client.responses.stream(
        model="tiny",
        input="Weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    [streamed] = final.output
    assert streamed.type == "function_call" and streamed.arguments == item.arguments

    engine.reply = "18C in Paris."
    second = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": item.call_id,
                "name": item.name,
                "arguments": item.arguments,
            },
            {"type": "function_call_output", "call_id": item.call_id, "output": "18C"},
        ],
        tools=[tool],  # type: ignore[list-item]
    )
    assert second.output_text == "18C in Paris."
    prompt = bytes(engine.requests[-1][1].prompt_token_ids).decode()
    assert "<tool_response>\n18C\n</tool_response>" in prompt and "<tool_call>" in prompt


# -- the real engine -------------------------------------------------------------------------
@pytest.mark.slow
def test_parse_on_the_real_engine(tmp_path: Path) -> None:
    from sluice.engine.backends.torch_backend import TorchEngineBackend
    from sluice.engine.config import EngineConfig
    from sluice.engine.preset import ensure_tiny_llama
    from sluice.engine.tokenizer import Tokenizer
    from tests.unit.consumers.engine_harness import WorkerThread

    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=1, pools=("tiny-llama",)).specs())
    config = EngineConfig(
        block_size=16, num_kv_blocks=128, max_model_len=1024, max_num_batched_tokens=1024
    )
    backend = TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=tmp_path)
    worker = WorkerThread(bus, backend, pool="tiny-llama").start(60)
    tokenizer = Tokenizer.from_dir(ensure_tiny_llama(tmp_path))
    model = ServedModel(name="tiny-llama", max_model_len=1024, tokenizer=tokenizer)
    app = create_app(gateway_settings(), bus, [model])
    try:
        with (
            ServerThread(app) as server,
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY) as client,
        ):
            completion = client.chat.completions.parse(
                model="tiny-llama",
                messages=[{"role": "user", "content": "A city?"}],
                response_format=SmallCity,
                temperature=0,
                seed=1,
                max_tokens=120,
            )
            parsed = completion.choices[0].message.parsed
            assert isinstance(parsed, SmallCity), completion.choices[0].message.content
            jsonschema.validate(parsed.model_dump(), SmallCity.model_json_schema())

            # a named tool_choice: the grammar makes even random weights write the call
            params = {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,  # else random weights add keys forever
            }
            tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
            forced = client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": "Weather?"}],
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=False,
                temperature=0,
                max_tokens=120,
            ).choices[0]
            assert forced.finish_reason == "tool_calls", forced.message
            [call] = forced.message.tool_calls or []
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), params)  # type: ignore[union-attr]
    finally:
        worker.stop()
        bus.close()
