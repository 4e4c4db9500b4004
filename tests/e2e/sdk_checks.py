"""The same checks with the official `openai` SDK against any running Sluice."""

from __future__ import annotations

import openai

MODEL = "tiny-llama"


def check_chat(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert choice.message.content
    return choice.message.content


def check_chat_stream(client: openai.OpenAI, expected: str) -> openai.types.CompletionUsage:
    """The stream of `check_chat`'s call says the same; its usage (what the client is told)."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == expected  # greedy: the stream says what the plain call said
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 8
    return usage


def check_completions_with_token_ids(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 4
    assert reply.usage.completion_tokens == 6
    assert reply.choices[0].finish_reason == "length"


def check_responses_websocket(client: openai.OpenAI) -> None:
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Hello there", max_output_tokens=6)
        kinds, text = [], ""
        for event in connection:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                break
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    assert text
