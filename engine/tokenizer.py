"""Tokenizer wrapper and incremental detokenizer with stop strings (the engine's text edge).

`Tokenizer` wraps a `tokenizers.Tokenizer` loaded from a Hugging Face directory's
tokenizer.json, with the special tokens and chat template from tokenizer_config.json or
chat_template.jinja; the template renders in a jinja2 `ImmutableSandboxedEnvironment`.
`IncrementalDetokenizer` turns one request's sampled tokens into text deltas for the
engine core: it waits out partial UTF-8 sequences, holds back text that could still become
a stop string, and drops the stop string itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_GIL_FREE_CHARS = 4096  # texts this long are encoded without holding the GIL


class TokenizerError(ValueError):
    """The tokenizer files are unusable, or a chat template failed (permanent)."""


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        eos = [] if eos_token is None else [tokenizer.token_to_id(eos_token)]
        ids = [i for i in (*eos, *extra_eos_token_ids) if i is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja when present)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        if template is None:
            template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(
            tok,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            chat_template=template,
            extra_eos_token_ids=extra_eos_token_ids,
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The `tokenizers` tokenizer as tokenizer.json text (llguidance builds on it)."""
        return str(self._tok.to_str())

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: no token covers more text than it."""
        return max(len(piece) for piece in self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _GIL_FREE_CHARS:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        # encode_batch lets go of the GIL while it works (encode holds it throughout), so
        # a long prompt tokenized on a worker thread does not stall the gateway's loop
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the chat template (sandboxed); token ids when `tokenize`, else text."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template")
        try:
            template = _compiled(self.chat_template)
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """A chat template compiled once: compiling took ~0.9 ms of each ~1 ms render (every
    chat request and batch line renders one); a compiled template renders thread-safely."""
    return _environment().from_string(source)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDetokenizer:
    """Text deltas for one request's new tokens, with stop-string hold-back.

    `add_token(id)` returns the text that is now safe to emit (possibly ""). After a stop
    string appears, `stop_reason` holds it, `finished` is True, and nothing after it (nor
    the stop string) is ever emitted. When the request ends for another reason, call
    `flush()` for the held-back tail. Decoding re-reads a short window of tokens
    (vLLM's prefix/read offsets), so multi-byte characters split across tokens come out
    whole and word-boundary spaces stay right; prompt ids seed that window.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._text = ""  # all decoded output text (stop string and after cut off once found)
        self._emitted = 0  # chars of _text already returned
        self.stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def add_token(self, token_id: int) -> str:
        if self.stop_reason is not None:
            return ""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence (or nothing visible) so far
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if len(self._ids) > 64:  # keep the window short; offsets move with it
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        return self._append(new)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def _append(self, new: str) -> str:
        old_len = len(self._text)
        self._text += new
        if not self._stop:
            self._emitted = len(self._text)
            return new
        search_from = max(0, old_len - self._max_stop + 1)
        hit: tuple[int, str] | None = None
        for s in self._stop:
            i = self._text.find(s, search_from)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            self._text = self._text[: hit[0]]
            self.stop_reason = hit[1]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out

    def flush(self) -> str:
        """The held-back tail, for a request that ended without hitting a stop string."""
        return self._take(len(self._text))
