"""What the gateway serves: models with their tokenizers, injected by the composition root.

The gateway tokenizes and renders chat templates itself (docs/architecture.md §4: prompt
token ids travel on the bus), through the `Tokenizer` protocol; `engine.tokenizer.Tokenizer` is
the real one, passed in from `sluice/` because `api` never imports `engine`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.api.errors import ModelNotFound


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can cover (bounds a prompt's chars)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """May run on a worker thread: long texts must not hold the GIL throughout."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """`kwargs` reach the template as variables (`tools`, as transformers passes them)."""
        ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of `GET /v1/models`, and what validation needs to know about it."""

    name: str
    max_model_len: int
    tokenizer: Tokenizer
    # how the model writes tool calls and reasoning (SLUICE_TOOL_PARSER, SLUICE_REASONING_PARSER)
    tool_parser: str = "hermes"
    reasoning_parser: str = "none"
    # (kind, value) of a StructuredSpec → raises ValueError when it cannot compile for this
    # model's vocabulary (`engine.structured.GrammarCompiler.check`); None: not checked
    check_constraint: Callable[[str, str], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "sluice"


class ModelCatalog:
    """Served models by name."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        self._models = {m.name: m for m in models}

    def __iter__(self) -> Any:
        return iter(self._models.values())

    def get(self, name: str) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(
                f"the model '{name}' does not exist; GET /v1/models lists the served ones",
                param="model",
            )
        return model
