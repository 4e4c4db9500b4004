"""Tool-call and reasoning parsers: what a whole output reads as, and that a stream split
anywhere reads the same (the non-streaming answer and the stream must agree)."""

from __future__ import annotations

import json

import pytest

from sluice.api.output import OutputPlan, read_whole
from sluice.api.reasoning import ReasoningParser
from sluice.api.tool_parsers import CallDelta, ToolCallParser, parse_tool_calls

WEATHER = '{"city": "Paris", "units": ["c", {"x": "}]"}]}'
CASES = [
    (
        "hermes",
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {"q": 1}, "name": "search"}\n</tool_call>',
        "Let me check.",
        [("get_weather", WEATHER), ("search", '{"q": 1}')],
    ),
    (
        "hermes",
        "plain text with < and <tool and <tool_c in it ",
        "plain text with < and <tool and <tool_c in it ",
        [],
    ),
    (
        "hermes",
        "<tool_call>\nnot json</tool_call> after",
        "<tool_call>\nnot json</tool_call> after",
        [],
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "b', None, [("f", '{"a": "b')]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"a": 1}'), ("g", "{}")],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    (
        "llama3_json",
        'Hello {"name": "f", "parameters": {}}',
        'Hello {"name": "f", "parameters": {}}',
        [],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": '
        '{"b": "]"}}]',
        "Sure.",
        [("f", '{"a": 1}'), ("g", '{"b": "]"}')],
    ),
]


def _streamed(family: str, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    parser = ToolCallParser(family)
    pieces, at = [], 0
    for cut in [*cuts, len(text)]:
        pieces += parser.feed(text[at:cut])
        at = cut
    pieces += parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, CallDelta):
            if p.id is not None:
                assert p.index not in calls and p.id.startswith("call_") and p.name
                calls[p.index] = [p.name, ""]
            calls[p.index][1] += p.arguments
    return content or None, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_whole_output(
    family: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = parse_tool_calls(family, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    if not text.endswith('"b'):  # all but the truncated call hold JSON arguments
        for call in got_calls:
            json.loads(call.arguments)


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_a_stream_split_anywhere_reads_the_same(
    family: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    for cut in range(len(text) + 1):  # every single split point
        assert _streamed(family, text, [cut]) == (content, calls), cut
    for step in (1, 2, 3):  # and every character on its own (every boundary at once)
        assert _streamed(family, text, list(range(step, len(text), step))) == (content, calls)


def test_arguments_stream_as_they_are_written() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("<tool_call>\n") == []
    start, first = parser.feed('{"name": "f", "arguments": {')
    assert isinstance(start, CallDelta) and start.name == "f" and start.id
    assert first == CallDelta(0, arguments="{")
    assert parser.feed('"a": ') == [CallDelta(0, arguments='"a": ')]
    assert parser.feed("1}}\n</tool_call>") == [CallDelta(0, arguments="1}")]
    assert parser.finish() == []


def test_text_that_may_start_a_marker_is_held_back() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Hi <tool") == ["Hi"]  # the space waits too: it may precede a call
    assert parser.feed("box> done") == [" <toolbox> done"]


REASONED = "<think>\nThe user wants X.\n</think>\n\nThe answer is X."


@pytest.mark.parametrize("starts_inside", [False, True])
def test_reasoning_split_anywhere(starts_inside: bool) -> None:
    text = REASONED.removeprefix("<think>") if starts_inside else REASONED
    for cut in range(len(text) + 1):
        parser = ReasoningParser(starts_inside)
        r1, c1 = parser.feed(text[:cut])
        r2, c2 = parser.feed(text[cut:])
        r3, c3 = parser.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == ("\nThe user wants X.\n", "The answer is X.")
        assert parser.reasoning == "\nThe user wants X.\n"


def test_no_think_block_is_all_answer() -> None:
    parser = ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink? no") == ("", "<think? no")
    assert parser.reasoning is None


def test_reasoning_then_tool_call() -> None:
    plan = OutputPlan(tool_family="hermes", reasoning=True)
    text = '<think>call it</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    reader = read_whole(plan, text)
    assert reader.reasoning == "call it"
    assert reader.content is None
    assert [(c.name, c.arguments) for c in reader.calls] == [("f", "{}")]
