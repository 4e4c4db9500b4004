"""Structured outputs: a `Constraint` compiled into an llguidance grammar, one matcher per
request that masks the tokens the grammar cannot take next.

`GrammarCompiler` (one per tokenizer) builds the `LLTokenizer` once, compiles each distinct
constraint once (an LRU of pristine `LLMatcher`s; a request gets a `deep_copy`, ~10 µs) and
answers `check` for the gateway: a `StructuredOutputError` (400) for a schema, regex or
grammar that does not compile. Compiles run on its one worker thread (`matcher_async`), so
the engine step of other requests never waits on one; llguidance drops the GIL while it
compiles. `RequestMatcher` is one request's state: the text it waits for (`after`) before
the constraint starts, the tokens consumed, the bitmask of what may come next.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.engine.sampling import Constraint

if TYPE_CHECKING:
    import llguidance

    from sluice.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# compact JSON: a free choice of whitespace lets a weak model spin in blanks until
# max_tokens; a schema's own "x-guidance" options still override this
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A constraint that cannot compile (permanent: the request is wrong)."""


def grammar_for(constraint: Constraint) -> str:
    """The llguidance grammar of `constraint` (not yet compiled; raises
    StructuredOutputError for a value that is not even of the right shape)."""
    from llguidance import LLMatcher

    kind, value = constraint.kind, constraint.value
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise StructuredOutputError(f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError("json_schema must be a JSON object")
        try:
            return LLMatcher.grammar_from_json_schema(
                tightened(schema) if isinstance(schema, dict) else {},
                defaults=_JSON_OPTIONS,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise StructuredOutputError(f"invalid json_schema: {_one_line(str(exc))}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        try:
            choices = json.loads(value)
        except ValueError:
            choices = None
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise StructuredOutputError("choice must be a JSON list of non-empty strings")
        # JSON string escapes are Lark string escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(_bounded_lark(value))
    raise StructuredOutputError(f"unknown structured output kind {kind!r}; one of {KINDS}")


# RFC 8259 §6: integers beyond ±(2**53 - 1) are not interoperable (IEEE doubles)
_SAFE_INTEGER = 2**53 - 1
# keywords whose values are JSON data, not schemas: never rewritten
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


def tightened(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` as the engine constrains it: every output still validates against the
    schema as written, but a weak model cannot run to max_tokens inside it.

    - an integer or number with no bound of its own is held to the interoperable range
      ±(2**53 - 1) (greedy loops write "1222222..." otherwise);
    - an object that lists `properties` and says nothing of others takes no others (what
      OpenAI's strict mode and xgrammar's, vLLM's default, do): a model free to add keys
      adds them until max_tokens. Not inside `allOf`, whose members each see only part
      of the object's properties.
    """
    if isinstance(schema, list):
        return [tightened(item, in_all_of) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in _DATA_KEYWORDS else tightened(value, key == "allOf")
        for key, value in schema.items()
    }
    types = out.get("type")
    named = {types} if isinstance(types, str) else set(types or ())
    if named & {"integer", "number"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _SAFE_INTEGER
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    lists = isinstance(out.get("properties"), dict)
    if lists and not in_all_of and not any(key in out for key in open_keys):
        out["additionalProperties"] = False
    return out


def _bounded_lark(lark: str) -> str:
    """A Lark grammar with its embedded `%json{...}` schemas `tightened` as a json_schema
    is (a tool call's arguments, say)."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while (at := lark.find("%json", pos)) != -1:
        start = at + len("%json")
        while start < len(lark) and lark[start].isspace():
            start += 1
        try:
            schema, end = decoder.raw_decode(lark, start)
        except ValueError:  # not a schema here: llguidance reports it
            out.append(lark[pos:start])
            pos = start
            continue
        out.append(lark[pos:at] + "%json" + json.dumps(tightened(schema)))
        pos = end
    return "".join(out) + lark[pos:]


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe.

    vocab_size: the width of the model's logits (the mask covers it; ids past the
    tokenizer's are never allowed). eos_token_ids: what ends a request that the grammar
    allows to end (the engine's EOS ids; default the tokenizer's).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        cache_size: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self.eos_token_ids = list(
            tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
        )
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._llt: llguidance.LLTokenizer | None = None
        self._singles: dict[str, list[int]] = {}
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        llt = self._llt
        if llt is None:
            from llguidance import LLTokenizer

            with self._lock:
                if self._llt is None:
                    self._llt = LLTokenizer(
                        self.tokenizer.to_json(),
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids or None,
                    )
                llt = self._llt
        return llt

    def single_tokens(self, chars: str) -> list[int]:
        """The ids of those of `chars` that are one token each, in order."""
        found = self._singles.get(chars)
        if found is None:
            found = []
            for ch in chars:
                ids = self.tokenizer.encode(ch, add_special_tokens=False)
                if len(ids) == 1 and self.ll_tokenizer.decode_bytes(ids) == ch.encode():
                    found.append(ids[0])
            self._singles[chars] = found
        return found

    @property
    def mask_words(self) -> int:
        """int32 words in one bitmask row."""
        return (self.vocab_size + 31) // 32

    def check(self, constraint: Constraint) -> None:
        """Raise StructuredOutputError if `constraint` cannot compile (cached)."""
        self._compiled(constraint)

    def cached_error(self, constraint: Constraint) -> str | None:
        """The compile error already known for `constraint`, without compiling."""
        with self._lock:
            entry = self._cache.get((constraint.kind, constraint.value))
        return entry if isinstance(entry, str) else None

    def matcher(self, constraint: Constraint) -> RequestMatcher:
        """A fresh matcher for one request (compiles on this thread if not cached)."""
        return RequestMatcher(self, self._compiled(constraint).deep_copy(), constraint.after)

    def matcher_async(
        self, constraint: Constraint, replay: Sequence[int] = ()
    ) -> Future[RequestMatcher]:
        """`matcher` on the compiler's worker thread, with `replay` (output tokens of an
        earlier attempt) consumed; the future raises StructuredOutputError."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
            pool = self._pool

        def build() -> RequestMatcher:
            matcher = self.matcher(constraint)
            matcher.sync(replay)
            return matcher

        return pool.submit(build)

    def _compiled(self, constraint: Constraint) -> llguidance.LLMatcher:
        key = (constraint.kind, constraint.value)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if entry is None:
            entry = self._compile(constraint)  # outside the lock: it may take a while
            with self._lock:
                self._cache[key] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise StructuredOutputError(entry)
        return entry

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher | str:
        from llguidance import LLMatcher

        try:
            grammar = grammar_for(constraint)
        except StructuredOutputError as exc:
            return str(exc)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"invalid {constraint.kind}: {_one_line(matcher.get_error())}"
        return matcher

    def close(self) -> None:
        pool = self._pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class RequestMatcher:
    """One request's grammar state. Until the output holds `after` (when set), nothing is
    constrained; from the token that completes it, a fresh grammar starts (what that token
    holds past `after` is not seen by the grammar)."""

    __slots__ = (
        "_after",
        "_compiler",
        "_consumed",
        "_escaped",
        "_matcher",
        "_pristine",
        "_tail",
        "active",
        "in_string",
    )

    def __init__(
        self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher, after: str | None
    ) -> None:
        self._compiler = compiler
        self._pristine = matcher.deep_copy()
        self._matcher = matcher
        self._after = after.encode() if after else b""
        self._tail = b""
        self._consumed = 0
        self.in_string = self._escaped = False
        self.active = not after  # the grammar constrains the next token
        # inside a JSON string of the constrained output (its unescaped quotes are odd)
        self.in_string = False
        self._escaped = False

    @property
    def num_consumed(self) -> int:
        return self._consumed

    def single_tokens(self, chars: str) -> list[int]:
        return self._compiler.single_tokens(chars)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes nothing more (an error counts as stopped)."""
        return self.active and self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None

    def accepts(self, token_id: int) -> bool:
        """Whether the grammar takes `token_id` next (not consumed)."""
        return self._matcher.validate_tokens([token_id]) == 1

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask (int32 words, bit set = allowed) into `row`."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token_id: int) -> bool:
        """Take one output token; True when the grammar has stopped after it."""
        self._consumed += 1
        if self.active:
            self._matcher.consume_token(token_id)
            self._track_strings(self._compiler.ll_tokenizer.decode_bytes([token_id]))
            return self._matcher.is_stopped()
        # waiting for `after`: look for it in the bytes seen so far (a bounded tail)
        tail = self._tail + self._compiler.ll_tokenizer.decode_bytes([token_id])
        if self._after in tail:
            self.active = True
            self._tail = b""
        else:
            self._tail = tail[-(len(self._after) - 1) :] if len(self._after) > 1 else b""
        return False

    def _track_strings(self, text: bytes) -> None:
        for byte in text:
            if self._escaped:
                self._escaped = False
            elif byte == 0x5C and self.in_string:  # a backslash escapes what follows
                self._escaped = True
            elif byte == 0x22:  # '"'
                self.in_string = not self.in_string

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Consume what `output_token_ids` holds past the tokens taken so far; a shorter
        list than that (never expected) starts over from a fresh grammar."""
        if len(output_token_ids) < self._consumed:
            self._restart()
        for token_id in output_token_ids[self._consumed :]:
            self.consume(token_id)

    def _restart(self) -> None:
        self._matcher = self._pristine.deep_copy()
        self.active = not self._after
        self._tail = b""
        self._consumed = 0
