"""`sluice serve` with the upstream backend in front of other `sluice serve` processes,
driven with the openai SDK: streamed answers equal the upstream's own, and a stream
survives the upstream serving it being killed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving, serving_args, wait_ready

pytestmark = pytest.mark.slow

PROMPT = "The upstream says"


def _front_env(*upstreams: str) -> dict[str, str]:
    return {
        "SLUICE_BACKEND": "upstream",
        "SLUICE_UPSTREAM_URLS": ",".join(upstreams),
        "SLUICE_UPSTREAM_API_KEY": API_KEY,
        "SLUICE_UPSTREAM_HEALTH_PATH": "/readyz",  # sluice serve's /health answers early
    }


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _streamed_text(client: OpenAI, max_tokens: int) -> tuple[str, int]:
    """A greedy streamed completion: its text and completion_tokens."""
    stream = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    text, completion_tokens = "", -1
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return text, completion_tokens


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir = tmp_path_factory.mktemp("upstream")
    with serving(data_dir, data_dir / "serve.log") as (base, _):
        yield base


def test_front_streams_the_upstreams_answer(
    upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The front started with the command-line flags: `--backend upstream --upstream-url`."""
    data_dir = tmp_path_factory.mktemp("front")
    port = free_port()
    args = [*serving_args("serve", port, data_dir), "--backend", "upstream"]
    env = {"SLUICE_UPSTREAM_API_KEY": API_KEY, "SLUICE_UPSTREAM_HEALTH_PATH": "/readyz"}
    proc = SluiceProcess([*args, "--upstream-url", upstream], data_dir / "serve.log", env)
    front = f"http://127.0.0.1:{port}"
    try:
        wait_ready(front, proc.start())
        expected = _streamed_text(_client(upstream), 24)
        assert _streamed_text(_client(front), 24) == expected
        chat = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        own = _client(upstream).chat.completions.create(**chat)  # type: ignore[call-overload]
        via = _client(front).chat.completions.create(**chat)  # type: ignore[call-overload]
        assert via.choices[0].message.content == own.choices[0].message.content
        assert via.usage.completion_tokens == own.usage.completion_tokens
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


def test_a_stream_survives_its_upstream_killed(
    upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two upstreams; the one serving the stream is killed -9 after its first chunk: the
    client's stream still ends with the whole greedy answer."""
    expected = _streamed_text(_client(upstream), 64)
    second_dir = tmp_path_factory.mktemp("upstream-b")
    port = free_port()
    second_proc = SluiceProcess(
        serving_args("serve", port, second_dir), second_dir / "serve.log"
    ).start()
    second = f"http://127.0.0.1:{port}"
    try:
        wait_ready(second, second_proc)
        front_dir = tmp_path_factory.mktemp("front-b")
        env = _front_env(second, upstream)  # an idle front sends its first request to `second`
        with serving(front_dir, front_dir / "serve.log", env) as (front, _):
            stream = _client(front).completions.create(
                model="tiny-llama",
                prompt=PROMPT,
                max_tokens=64,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
                stream_options={"include_usage": True},
            )
            text, completion_tokens = "", -1
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    if second_proc.proc is not None and second_proc.proc.poll() is None:
                        os.killpg(second_proc.proc.pid, signal.SIGKILL)
                        second_proc.proc.wait()
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
    finally:
        second_proc.stop()
    assert second_proc.proc is not None and second_proc.proc.returncode == -signal.SIGKILL
    assert (text, completion_tokens) == expected


def test_a_stream_resumes_once_its_only_upstream_is_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The only upstream is killed -9 mid-stream and started again on its port: the
    front's engine worker restarts the backend once the upstream answers, the request
    resumes there from the tokens the client already has, and the stream ends whole."""
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"

    def start_upstream(name: str) -> SluiceProcess:
        data_dir = tmp_path_factory.mktemp(name)
        proc = SluiceProcess(serving_args("serve", port, data_dir), data_dir / "serve.log")
        wait_ready(upstream, proc.start())
        return proc

    first = start_upstream("only-a")
    expected = _streamed_text(_client(upstream), 64)
    second: SluiceProcess | None = None
    try:
        front_dir = tmp_path_factory.mktemp("front-c")
        with serving(front_dir, front_dir / "serve.log", _front_env(upstream)) as (front, _):
            stream = _client(front).completions.create(
                model="tiny-llama",
                prompt=PROMPT,
                max_tokens=64,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
                stream_options={"include_usage": True},
            )
            text, completion_tokens = "", -1
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    if second is None:
                        assert first.proc is not None
                        os.killpg(first.proc.pid, signal.SIGKILL)
                        first.proc.wait()
                        second = start_upstream("only-b")
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
            assert second is not None
            assert (text, completion_tokens) == expected
    finally:
        first.stop()
        if second is not None:
            second.stop()
