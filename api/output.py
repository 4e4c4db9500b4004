"""What a chat or Responses answer is read into: reasoning, content, tool calls.

`OutputPlan` says which readers a request's output goes through (the served model's
reasoning and tool parsers, the request's tools); `ChoiceReader` runs them over one
choice's text as it streams, reasoning first, and keeps the whole for the final answer.
Non-streaming answers, streams and batch output lines all read through it, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.api.reasoning import ReasoningParser, template_opens_think
from sluice.api.served import ServedModel
from sluice.api.tool_parsers import CallDelta, ToolCall, ToolCallParser
from sluice.api.tools import ToolPlan


@dataclass(frozen=True, slots=True)
class OutputPlan:
    tool_family: str | None = None  # read tool calls in this format; None: never
    reasoning: bool = False
    starts_in_reasoning: bool = False

    @property
    def plain(self) -> bool:
        return self.tool_family is None and not self.reasoning


def output_plan(model: ServedModel, tools: ToolPlan | None) -> OutputPlan:
    reasoning = model.reasoning_parser == "think"
    return OutputPlan(
        tool_family=model.tool_parser if tools is not None and tools.parses else None,
        reasoning=reasoning,
        starts_in_reasoning=reasoning and template_opens_think(model.tokenizer),
    )


@dataclass(slots=True)
class Piece:
    """A part of the output: reasoning text, answer text, or part of a tool call."""

    reasoning: str = ""
    content: str = ""
    call: CallDelta | None = None


@dataclass
class ChoiceReader:
    plan: OutputPlan
    _reasoning: ReasoningParser | None = field(init=False, default=None)
    _tools: ToolCallParser | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.plan.reasoning:
            self._reasoning = ReasoningParser(self.plan.starts_in_reasoning)
        if self.plan.tool_family is not None:
            self._tools = ToolCallParser(self.plan.tool_family)
        self._content = ""

    def feed(self, text: str) -> list[Piece]:
        return self._read(text, final=False)

    def finish(self) -> list[Piece]:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish() if final else self._reasoning.feed(text)
            if reasoning:
                out.append(Piece(reasoning=reasoning))
        if self._tools is None:
            if text:
                self._content += text
                out.append(Piece(content=text))
            return out
        pieces = self._tools.feed(text) if text else []
        if final:
            pieces += self._tools.finish()
        for p in pieces:
            out.append(Piece(content=p) if isinstance(p, str) else Piece(call=p))
        return out

    @property
    def reasoning(self) -> str | None:
        return None if self._reasoning is None else self._reasoning.reasoning

    @property
    def content(self) -> str | None:
        if self._tools is not None:
            return self._tools.content or None
        return self._content

    @property
    def calls(self) -> list[ToolCall]:
        return [] if self._tools is None else self._tools.calls


def read_whole(plan: OutputPlan, text: str) -> ChoiceReader:
    reader = ChoiceReader(plan)
    reader.feed(text)
    reader.finish()
    return reader


def reasoning_tokens(tokenizer: Any, readers: list[ChoiceReader]) -> int:
    """Tokens of the reasoning blocks, counted by tokenizing their text again."""
    return sum(
        len(tokenizer.encode(r.reasoning, add_special_tokens=False)) for r in readers if r.reasoning
    )
