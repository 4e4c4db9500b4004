"""A GGUF file's tokenizer metadata -> a `tokenizers.Tokenizer` (the engine's text edge).

Called by `engine.gguf_file` when a GGUF checkpoint loads. A GGUF has no tokenizer.json:
llama.cpp stores the vocabulary, merges (or sentencepiece scores), token types and the
name of the pre-tokenizer (`tokenizer.ggml.pre`) as metadata. This rebuilds the
tokenizer Hugging Face would ship for that vocabulary, as transformers' GGUF converter
does, with the pre-tokenizer split llama.cpp applies for that name. A pre-tokenizer
name not in `PRE_TOKENIZER_SPLITS` is refused, as llama.cpp refuses it: a wrong split
gives quietly different token ids.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: special tokens such as <|im_end|>
TOKEN_TYPE_USER_DEFINED = 4  # added tokens matched whole but not special, such as <think>

# `tokenizer.ggml.pre` -> the split regex of llama.cpp's llama-vocab.cpp for it; None
# means GPT-2's own split (ByteLevel's built-in regex); "digits" means GPT-2's after each
# digit is split off alone (StarCoder's and SmolLM's tokenizer.json: Digits + ByteLevel)
_GPT2 = None
_DIGITS = "digits"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _DIGITS,
    "starcoder": _DIGITS,
    "refact": _DIGITS,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
# Llama 3's tokenizer.json takes a pre-token that is itself in the vocabulary whole
# (`ignore_merges`); llama.cpp does the same for these pre-tokenizers
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing or names something unsupported (permanent)."""


@dataclass(frozen=True, slots=True)
class TokenizerMetadata:
    """The `tokenizer.ggml.*` keys this module reads, as plain values."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece BPE)
    tokens: Sequence[str]
    token_types: Sequence[int] = ()
    merges: Sequence[str] = ()
    scores: Sequence[float] = ()
    pre: str | None = None
    bos_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos_token: bool | None = None
    add_space_prefix: bool | None = None


def build_tokenizer(meta: TokenizerMetadata) -> HFTokenizer:
    """The Hugging Face tokenizer the metadata describes (raises GGUFTokenizerError)."""
    if meta.model == "gpt2":
        tok, add_bos = _byte_level(meta), bool(meta.add_bos_token)
    elif meta.model == "llama":
        tok = _sentencepiece(meta)
        add_bos = True if meta.add_bos_token is None else meta.add_bos_token
    else:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {meta.model!r} is not supported; expected 'gpt2' or 'llama'"
        )
    _add_special_tokens(tok, meta)
    bos = meta.bos_token_id
    if add_bos and bos is not None and 0 <= bos < len(meta.tokens):
        name = meta.tokens[bos]
        template = processors.TemplateProcessing(
            single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, bos)]
        )
        tok.post_processor = (
            processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
            if meta.model == "gpt2"
            else template
        )
    return tok


def _byte_level(meta: TokenizerMetadata) -> HFTokenizer:
    if meta.pre is not None and meta.pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre {meta.pre!r} (the pre-tokenizer) is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    if not meta.merges:
        raise GGUFTokenizerError("a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    vocab = {_byte_spelling(token): i for i, token in enumerate(meta.tokens)}
    merges = [_merge_pair(m) for m in meta.merges]
    tok = HFTokenizer(
        models.BPE(vocab, merges, ignore_merges=meta.pre in _IGNORE_MERGES, fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(meta.pre or "default")
    if split is _GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        assert split is not None
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if split == _QWEN2:
        tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: TokenizerMetadata) -> HFTokenizer:
    """Llama/Mistral's sentencepiece BPE with byte fallback, as transformers' LlamaTokenizer."""
    vocab = {token: i for i, token in enumerate(meta.tokens)}
    if meta.merges:
        merges = [_merge_pair(m) for m in meta.merges]
    elif meta.scores:
        merges = merges_from_scores(meta.tokens, meta.scores)
    else:
        raise GGUFTokenizerError("a 'llama' tokenizer needs tokenizer.ggml.merges or .scores")
    unk = meta.unk_token_id
    unk_token = meta.tokens[unk] if unk is not None and 0 <= unk < len(meta.tokens) else None
    tok = HFTokenizer(
        models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    prefix = meta.add_space_prefix is not False
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a token into two
    tokens, best score first (transformers' `generate_merges` with vocab scores)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=False):
        local = [
            (token[:k], token[k:], float(score))
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tok: HFTokenizer, meta: TokenizerMetadata) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens,
    so both are matched whole in text (as llama.cpp does) instead of cut into pieces."""
    alphabet = _byte_alphabet() if meta.model == "gpt2" else None
    control, user = [], []
    for token, kind in zip(meta.tokens, meta.token_types, strict=False):
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet):
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise GGUFTokenizerError(f"tokenizer.ggml.merges entry {merge!r} is not 'left right'")
    return left, right


@functools.cache
def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (every byte-level vocabulary is spelled in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_unicode().values())


def _byte_spelling(token: str) -> str:
    """A token as the byte-level vocabulary spells it (a few files store raw text)."""
    alphabet = _byte_alphabet()
    if set(token) <= alphabet:
        return token
    spell = _byte_unicode()
    return "".join(spell[b] for b in token.encode("utf-8"))
