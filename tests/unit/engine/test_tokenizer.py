"""Tokenizer wrapper, sandboxed chat templates and the incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.engine.preset import CHAT_TEMPLATE, train_tokenizer
from sluice.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXT = "Hello, world! Café naïve 日本語 🙂🚀 and the sluice gate opens."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir, extra_eos_token_ids=[3])


def test_round_trip_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tok.eos_token_ids == (1, 3)


def test_chat_template_from_jinja_file(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert isinstance(ids, list) and ids[0] == tok.token_to_id("<|im_start|>")


def test_chat_template_from_tokenizer_config(tmp_path: Path) -> None:
    train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}!"})
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"


def test_chat_template_is_sandboxed(tok: Tokenizer) -> None:
    evil = Tokenizer(tok._tok, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError):
        evil.apply_chat_template([])
    raising = Tokenizer(tok._tok, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizerError, match="no system role"):
        raising.apply_chat_template([])


def test_no_template_is_an_error(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        Tokenizer(tok._tok).apply_chat_template([])


def test_incremental_deltas_rebuild_the_text_without_broken_utf8(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Say:"))
    deltas = [detok.add_token(t) for t in ids]
    assert "".join(deltas) + detok.flush() == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # multi-byte characters span several byte-level tokens


def test_stop_string_is_held_back_and_not_emitted(tok: Tokenizer) -> None:
    ids = tok.encode("The gate opens. STOP here and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["STOP", "never-seen"])
    out = ""
    for t in ids:
        out += detok.add_token(t)
        assert "STO" not in out  # a partial stop string is never emitted
        if detok.finished:
            break
    assert detok.finished and detok.stop_reason == "STOP"
    assert out == "The gate opens. "
    assert detok.add_token(ids[-1]) == "" and detok.flush() == ""


def test_held_back_prefix_is_released_when_it_diverges(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["gate!"])
    out = detok.add_tokens(tok.encode("the gat", add_special_tokens=False))
    assert out == "the "  # "gat" could still become "gate!"
    out += detok.add_tokens(tok.encode("ling", add_special_tokens=False))
    assert out == "the gatlin" and not detok.finished  # "g" may start "gate!"
    assert detok.flush() == "g"
    detok2 = IncrementalDetokenizer(tok, stop=["gate!"])
    out2 = detok2.add_tokens(tok.encode("a gat", add_special_tokens=False))
    assert out2 + detok2.flush() == "a gat"  # finished by length: flush the tail


def test_a_resumed_request_continues_the_text_exactly_at_any_split(tok: Tokenizer) -> None:
    """Failover: attempt 1 gets prompt + attempt 0's tokens (num_resumed_tokens). Its text
    must continue exactly where attempt 0's emitted text stopped, also when the split falls
    inside a multi-byte character (byte-level tokens) or inside held-back text."""
    from sluice.engine.core.request import Request
    from sluice.engine.engine_core import tokenizer_detokenizers
    from sluice.engine.sampling import SamplingParams

    make = tokenizer_detokenizers(tok)
    prompt = tok.encode("Tell me:")
    out = tok.encode(" héllo wörld ☃ 日本語 ünïcödé — done")
    params = SamplingParams(max_tokens=len(out), stop=["zzz"])
    full = make(Request("r", prompt, params))
    whole = full.add_tokens(out) + full.flush()
    assert whole == tok.decode(out, True)
    for k in range(len(out) + 1):
        first = make(Request("r", prompt, params))
        emitted = first.add_tokens(out[:k])
        resumed = make(Request("r", prompt + out[:k], params, num_resumed_tokens=k))
        rest = resumed.add_tokens(out[k:]) + resumed.flush()
        assert emitted + rest == whole, k
