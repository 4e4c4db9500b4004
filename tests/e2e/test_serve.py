"""`sluice serve` (one process, memory bus) driven by the official openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e import sdk_checks
from tests.e2e.procs import API_KEY, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(data_dir, tmp_path_factory.mktemp("serve") / "serve.log") as (base, proc):
        yield base
    assert API_KEY in proc.output()  # it printed the key it accepts


@pytest.fixture
def client(served: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def test_chat_plain_and_streamed(client: openai.OpenAI) -> None:
    text = sdk_checks.check_chat(client)
    sdk_checks.check_chat_stream(client, text)


def test_completions_with_token_ids(client: openai.OpenAI) -> None:
    sdk_checks.check_completions_with_token_ids(client)


def test_responses_over_websocket(client: openai.OpenAI) -> None:
    sdk_checks.check_responses_websocket(client)


def test_wrong_key_is_refused(served: str) -> None:
    bad = openai.OpenAI(base_url=f"{served}/v1", api_key="sk-wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
