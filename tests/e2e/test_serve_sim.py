"""`sluice serve` on the sim backend (SLUICE_BACKEND=sim): the same API, a modelled GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e import sdk_checks
from tests.e2e.procs import API_KEY, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("serve-sim") / "serve.log"
    env = {"SLUICE_BACKEND": "sim", "SLUICE_SIM_PRESET": "h100-llama3.1-8b-fp8"}
    with (
        serving(data_dir, log, env) as (base, _),
        openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as c,
    ):
        yield c


def test_chat_plain_and_streamed(client: openai.OpenAI) -> None:
    text = sdk_checks.check_chat(client)
    sdk_checks.check_chat_stream(client, text)


def test_completions_with_token_ids(client: openai.OpenAI) -> None:
    sdk_checks.check_completions_with_token_ids(client)


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = list(range(3, 70))  # four full blocks of 16 tokens, and some
    for expected in (0, 64):
        reply = client.completions.create(model=sdk_checks.MODEL, prompt=prompt, max_tokens=2)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens == expected
