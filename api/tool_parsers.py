"""Tool calls in a model's output text, read as they stream: one state machine per choice.

Families (SLUICE_TOOL_PARSER): `hermes` (Hermes, Qwen: `<tool_call>\\n{json}\\n</tool_call>`,
one block per call), `llama3_json` (Llama 3: the output starts with `{"name": ...,
"parameters": {...}}`, maybe after `<|python_tag|>`, several joined by `;`) and `mistral`
(`[TOOL_CALLS][{...}, ...]`). A call's JSON is `{"name", "arguments" | "parameters"}`.

`ToolCallParser.feed(text)` returns what can be told apart so far, in order: content text
and `CallDelta`s. Text that may still become a marker is held back; so is whitespace until
something follows it (whitespace around calls is dropped). A call whose JSON starts
`{"name": "...", "arguments": {` streams its arguments as the model writes them (their
raw text); any other valid call comes whole once its JSON closes; a block that is not a
call is content. The non-streaming answer is the same machine fed the whole text, so the
two always agree, however the text was split.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3_json", "mistral")

_PREFIX = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{\Z'
)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_OPEN = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDelta:
    """Part of tool call `index`: its first delta has `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Piece = str | CallDelta


@dataclass(slots=True)
class _Object:
    """One call's JSON object as it arrives, scanned character by character."""

    text: str = ""
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    args_start: int | None = None  # where the raw arguments object starts (streamed)
    args_end: int | None = None
    sent: int = 0  # characters of the arguments already sent
    complete: bool = False


@dataclass
class ToolCallParser:
    family: str = "hermes"
    new_id: Callable[[], str] = new_call_id
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown tool parser {self.family!r}")
        self._buf = ""  # text not decided yet
        self._mode = "text"  # text | open | object | after | passthrough
        self._raw = ""  # everything consumed since a marker (content again if no call)
        self._ws = ""  # whitespace held until something follows it
        self._obj: _Object | None = None
        self._started = False  # the current object's call has been announced
        self._at_start = True  # llama3: calls only open the output
        self._out: list[Piece] = []

    # -- public ------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[Piece]:
        """The rest, at the end of the output: held text, an unfinished call as it stands."""
        self._advance(final=True)
        if self._mode == "object" and self._obj is not None:
            self._end_object(final=True)
        elif self._mode == "open":
            self._invalid()
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        if self._ws and not self.calls:
            self._out.append(self._ws)
            self.content += self._ws
        self._ws = ""
        return self._take()

    # -- the machine ----------------------------------------------------------------------
    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        merged: list[Piece] = []
        for piece in out:
            if isinstance(piece, str) and merged and isinstance(merged[-1], str):
                merged[-1] += piece
            elif not (isinstance(piece, str) and not piece):
                merged.append(piece)
        return merged

    def _content(self, text: str) -> None:
        if not text:
            return
        self._at_start = self._at_start and not text.strip()
        held = self._ws + text
        kept = held.rstrip()
        self._ws = held[len(kept) :]
        if kept:
            self._out.append(kept)
            self.content += kept

    def _advance(self, final: bool) -> None:
        while self._buf:
            before = (self._mode, len(self._buf))
            step = getattr(self, f"_step_{self._mode}")
            step(final)
            if (self._mode, len(self._buf)) == before:
                return  # waiting for more text

    def _step_passthrough(self, final: bool) -> None:
        self._content(self._buf)
        self._buf = ""

    def _step_text(self, final: bool) -> None:
        if self.family == "llama3_json":
            self._step_llama_start(final)
            return
        marker = _HERMES_OPEN if self.family == "hermes" else _MISTRAL_OPEN
        i = self._buf.find(marker)
        if i >= 0:
            self._content(self._buf[:i])
            self._raw, self._buf = marker, self._buf[i + len(marker) :]
            self._mode = "open"
            return
        keep = 0 if final else _held_prefix(self._buf, marker)
        self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]

    def _step_llama_start(self, final: bool) -> None:
        if not self._at_start:
            self._mode = "passthrough"
            return
        stripped = self._buf.lstrip()
        lead = self._buf[: len(self._buf) - len(stripped)]
        if not stripped:
            if final:
                self._content(self._buf)
                self._buf = ""
            return
        if stripped.startswith(_PYTHON_TAG) or stripped.startswith("{"):
            tag = _PYTHON_TAG if stripped.startswith(_PYTHON_TAG) else ""
            self._ws += lead  # dropped if calls follow
            self._raw, self._buf = tag, stripped[len(tag) :]
            self._mode = "open"
            return
        if _PYTHON_TAG.startswith(stripped) and not final:
            return
        self._mode = "passthrough"

    def _step_open(self, final: bool) -> None:
        """After a marker (or a separator): whitespace, then a call's `{` (mistral: `[`)."""
        stripped = self._buf.lstrip()
        self._raw += self._buf[: len(self._buf) - len(stripped)]
        self._buf = stripped
        if not stripped:
            return
        if (
            self.family == "mistral"
            and stripped[0] == "["
            and self._raw.rstrip().endswith(_MISTRAL_OPEN)
        ):
            self._raw += "["
            self._buf = stripped[1:]
            return
        if stripped[0] == "{":
            self._obj, self._started = _Object(), False
            self._mode = "object"
            return
        self._invalid()

    def _invalid(self) -> None:
        """What followed a marker is no call: it was content after all."""
        self._content(self._raw)
        self._raw = ""
        self._mode = "passthrough" if self.family == "llama3_json" else "text"

    def _step_object(self, final: bool) -> None:
        obj = self._obj
        assert obj is not None
        used = 0
        for ch in self._buf:
            used += 1
            self._scan(obj, ch)
            if obj.complete:
                break
        self._buf = self._buf[used:]
        self._send_arguments(obj)
        if obj.complete:
            self._end_object(final=False)

    def _scan(self, obj: _Object, ch: str) -> None:
        pos = len(obj.text)
        obj.text += ch
        if obj.in_string:
            if obj.escape:
                obj.escape = False
            elif ch == "\\":
                obj.escape = True
            elif ch == '"':
                obj.in_string = False
            return
        if ch == '"':
            obj.in_string = True
        elif ch in "{[":
            if ch == "{" and obj.depth == 1 and not self._started:
                match = _PREFIX.match(obj.text)
                if match is not None:
                    self._announce(json.loads(f'"{match.group(1)}"'))
                    obj.args_start = pos
            obj.depth += 1
        elif ch in "}]":
            obj.depth -= 1
            if obj.depth == 1 and obj.args_start is not None and obj.args_end is None:
                obj.args_end = pos + 1
            if obj.depth == 0:
                obj.complete = True

    def _announce(self, name: str) -> None:
        self._started = True
        self._ws = ""  # whitespace before a call is not content
        index = len(self.calls)
        self.calls.append(ToolCall(self.new_id(), name, ""))
        self._out.append(CallDelta(index, self.calls[index].id, name))

    def _send_arguments(self, obj: _Object) -> None:
        if obj.args_start is None:
            return
        upto = obj.args_end if obj.args_end is not None else len(obj.text)
        if upto > obj.args_start + obj.sent:
            piece = obj.text[obj.args_start + obj.sent : upto]
            obj.sent += len(piece)
            self._add_arguments(piece)

    def _add_arguments(self, piece: str) -> None:
        call = self.calls[-1]
        call.arguments += piece
        self._out.append(CallDelta(len(self.calls) - 1, arguments=piece))

    def _end_object(self, final: bool) -> None:
        obj = self._obj
        assert obj is not None
        self._obj = None
        if not self._started:
            call = _whole_call(obj.text) if obj.complete else None
            if call is None:
                self._raw += obj.text
                self._invalid()
                return
            self._announce(call[0])
            self._add_arguments(call[1])
        self._raw = ""
        self._mode = "after"

    def _step_after(self, final: bool) -> None:
        """After a call's JSON: its closing tag (hermes), or the next call's separator."""
        stripped = self._buf.lstrip()
        if not stripped:
            self._buf = "" if final else self._buf
            return
        if self.family == "hermes":
            if stripped.startswith(_HERMES_CLOSE):
                self._buf = stripped[len(_HERMES_CLOSE) :]
                self._mode = "text"
            elif _HERMES_CLOSE.startswith(stripped) and not final:
                return
            else:
                self._buf, self._mode = stripped, "text"
            return
        sep = ";" if self.family == "llama3_json" else ","
        if stripped[0] == sep:
            self._buf, self._mode = stripped[1:], "open"
            self._raw = ""
        elif self.family == "mistral" and stripped[0] == "]":
            self._buf, self._mode = stripped[1:], "text"
        else:
            self._buf = stripped
            self._mode = "passthrough" if self.family == "llama3_json" else "text"


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _whole_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return value["name"], args
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(family: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when empty) and its tool calls."""
    parser = ToolCallParser(family)
    parser.feed(text)
    parser.finish()
    return parser.content or None, parser.calls
