"""`sluice serve` with two models: an engine per model, each request answered by its own
model (greedy output equal to that model served alone), both listed, an unknown model 404
at once, and a set of models that cannot fit refused at start with the figures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from sluice.engine.preset import write_tiny_llama
from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving_args, wait_ready

pytestmark = pytest.mark.slow

PROMPTS = ["The sluice gate", "Tokens stream back one by one", "A request waits its turn"]
SECOND = "tiny-b"


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny Llama with other weights (seed 1), served under its directory's name."""
    path = tmp_path_factory.mktemp("models") / SECOND
    path.mkdir()
    write_tiny_llama(path, seed=1)
    return path


@contextmanager
def _serve(data_dir: Path, log: Path, *models: str) -> Iterator[openai.OpenAI]:
    port = free_port()
    flags = [flag for model in models for flag in ("--model", model)]
    proc = SluiceProcess([*serving_args("serve", port, data_dir), *flags], log).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as client:
            yield client
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


def _greedy(client: openai.OpenAI, model: str) -> list[str]:
    return [
        client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]


def test_two_models_in_one_serve_answer_as_each_alone(
    data_dir: Path, second_model: Path, tmp_path: Path
) -> None:
    with _serve(data_dir, tmp_path / "both.log", "tiny-llama", str(second_model)) as client:
        listed = {m.id: m for m in client.models.list().data}
        assert {"tiny-llama", SECOND} <= set(listed)
        together = {name: _greedy(client, name) for name in ("tiny-llama", SECOND)}
        started = time.monotonic()
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        assert time.monotonic() - started < 2.0
        assert missing.value.code == "model_not_found"
        # both at once: each engine serves its own requests beside the other's
        stream_a = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        stream_b = client.chat.completions.create(
            model=SECOND, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert {c.model for c in stream_a} == {"tiny-llama"}
        assert {c.model for c in stream_b} == {SECOND}
    assert together["tiny-llama"] != together[SECOND]  # other weights: other answers
    for name, model in (("tiny-llama", "tiny-llama"), (SECOND, str(second_model))):
        with _serve(data_dir, tmp_path / f"{name}.log", model) as client:
            assert _greedy(client, name) == together[name]


def test_models_that_do_not_fit_are_refused_at_start(
    data_dir: Path, second_model: Path, tmp_path: Path
) -> None:
    """A KV cache per engine larger than the host's memory: refused with the figures."""
    args = [*serving_args("serve", free_port(), data_dir), "--model", "tiny-llama"]
    done = subprocess.run(
        [sys.executable, "-m", "sluice", *args, "--model", str(second_model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SLUICE_KV_CACHE_MB": str(64 * 1024 * 1024)},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "GiB available" in done.stderr and "tiny-b" in done.stderr, done.stderr
