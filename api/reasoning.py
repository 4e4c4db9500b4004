"""A `<think>…</think>` block at the head of the output, read apart from the answer.

SLUICE_REASONING_PARSER=think: output that opens with `<think>` (or whose chat template
already opened it at the end of the prompt, as DeepSeek-R1's does) is reasoning up to
`</think>`; the rest is the answer, its leading whitespace dropped. Output that opens
otherwise is all answer. A tag split across deltas is held back until it is whole.
"""

from __future__ import annotations

import functools
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    """One choice's text → (reasoning, content) pieces as they stream."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._mode = "reasoning" if starts_inside else "start"
        self._buf = ""
        self.reasoning: str | None = "" if starts_inside else None
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while self._buf:
            if self._mode == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(OPEN):
                    self._buf, self._mode, self.reasoning = stripped[len(OPEN) :], "reasoning", ""
                elif final or (stripped and not OPEN.startswith(stripped)):
                    self._mode = "content"
                else:
                    break
            elif self._mode == "reasoning":
                i = self._buf.find(CLOSE)
                if i >= 0:
                    reasoning += self._buf[:i]
                    self._buf, self._mode = self._buf[i + len(CLOSE) :], "after"
                    continue
                keep = 0 if final else _held(self._buf, CLOSE)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                break
            elif self._mode == "after":  # the answer's leading whitespace
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._mode = "content"
            else:
                content += self._buf
                self._buf = ""
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
        self.content += content
        return reasoning, content


def _held(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@functools.lru_cache(maxsize=16)
def _opens(tokenizer: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
    except ValueError:
        return False
    return isinstance(text, str) and text.rstrip().endswith(OPEN)


def template_opens_think(tokenizer: Any) -> bool:
    """Whether the chat template ends its generation prompt inside a `<think>` block."""
    try:
        return _opens(tokenizer)
    except TypeError:  # an unhashable tokenizer: render each time
        return bool(_opens.__wrapped__(tokenizer))
