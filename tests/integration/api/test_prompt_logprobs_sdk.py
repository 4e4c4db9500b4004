"""Completions `echo` with `logprobs`, and vLLM's `prompt_logprobs`, through the official
`openai` SDK on the real engine (tiny-llama, random weights): gateway, bus, engine worker
and torch engine in one process.

The prompt's tokens come first in each choice's logprobs, the first with null logprob and
top_logprobs (OpenAI's legacy format, as vLLM answers it); streamed, the first chunk of a
choice is the prompt with its logprobs. `prompt_logprobs` is vLLM's list (None first) of
{token_id: {logprob, rank, decoded_token}}, on each completions choice and at the top of a
chat answer, with the same values as echo's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from sluice.api.app import create_app
from sluice.api.served import ServedModel
from sluice.bus.memory import MemoryEventBus
from sluice.bus.topics import TopicLayout
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import ServerThread

pytestmark = pytest.mark.slow  # loads the torch engine

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from sluice.engine.backends.torch_backend import TorchEngineBackend
    from sluice.engine.config import EngineConfig
    from sluice.engine.preset import ensure_tiny_llama
    from sluice.engine.tokenizer import Tokenizer
    from tests.unit.consumers.engine_harness import WorkerThread

    data = tmp_path_factory.mktemp("data")
    bus = MemoryEventBus()
    bus.create_topics(TopicLayout(request_partitions=1, pools=("tiny-llama",)).specs())
    # a small token budget: the prompt is prefilled in chunks
    config = EngineConfig(
        block_size=4, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=4
    )
    backend = TorchEngineBackend.from_model("tiny-llama", config=config, data_dir=data)
    worker = WorkerThread(bus, backend, pool="tiny-llama").start(60)
    tokenizer = Tokenizer.from_dir(ensure_tiny_llama(Path(data)))
    model = ServedModel(name="tiny-llama", max_model_len=256, tokenizer=tokenizer)
    app = create_app(gateway_settings(), bus, [model])
    try:
        with (
            ServerThread(app) as server,
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY) as c,
        ):
            yield c
    finally:
        worker.stop()
        bus.close()


def test_echo_with_logprobs_puts_the_prompt_first(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny-llama", prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0
    )
    usage = out.usage
    assert usage is not None and usage.completion_tokens == 4
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    n = usage.prompt_tokens + usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(t is not None and 1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the completion's own part is what the request without echo answers
    plain = client.completions.create(
        model="tiny-llama", prompt=PROMPT, logprobs=2, max_tokens=4, temperature=0
    ).choices[0]
    assert choice.text == PROMPT + plain.text
    assert plain.logprobs is not None and plain.logprobs.token_logprobs is not None
    assert lp.token_logprobs[-4:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)


def test_a_streamed_echo_starts_with_the_prompt_and_its_logprobs(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny-llama", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0
    ).choices[0]
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            echo=True,
            logprobs=1,
            max_tokens=3,
            temperature=0,
            stream=True,
        )
    )
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs is not None and first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    streamed = [
        v
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for v in c.choices[0].logprobs.token_logprobs or []
    ]
    assert whole.logprobs is not None and whole.logprobs.token_logprobs is not None
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)


def check_vllm_prompt_logprobs(entries: list[Any], echoed: list[float | None], k: int) -> None:
    assert entries[0] is None and len(entries) == len(echoed)
    for entry, logprob in zip(entries[1:], echoed[1:], strict=True):
        # the prompt token, and the k most likely (it may be one of them)
        assert len(entry) in (k, k + 1)
        assert set(range(1, k + 1)) <= {v["rank"] for v in entry.values()}
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
        assert logprob in [pytest.approx(v["logprob"], abs=1e-5) for v in entry.values()]


def test_vllm_prompt_logprobs_on_completions_and_chat(client: openai.OpenAI) -> None:
    echoed = client.completions.create(
        model="tiny-llama", prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, temperature=0
    ).choices[0]
    assert echoed.logprobs is not None and echoed.logprobs.token_logprobs is not None
    prompt_part = echoed.logprobs.token_logprobs[:-1]
    out = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    entries = out.model_dump()["choices"][0]["prompt_logprobs"]
    check_vllm_prompt_logprobs(entries, prompt_part, 2)

    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    entries = chat.model_dump()["prompt_logprobs"]
    assert chat.usage is not None and len(entries) == chat.usage.prompt_tokens
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
