"""docker-compose.yml really runs: the stack from local images (scripts/compose-local,
podman) serves chat, streams and batches through its gateway, keeps every token of a
stream whose engine container is killed, and bills after a billing container restart."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.sdk_checks import check_chat, check_chat_stream
from tests.services import service_missing
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose-local"
API_KEY = "sk-compose-local-test"
BASE_URL = "http://127.0.0.1:8000/v1"
MODEL = "tiny-llama"
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 2040  # the context (2048) less the prompt: still running when the kill comes
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
# float32, the exact path: the kill test compares a resumed stream with an uninterrupted
# run, which bf16's batch-dependent rounding does not reproduce (docs/architecture.md §7)
ENV = {**os.environ, "SLUICE_API_KEYS": API_KEY, "SLUICE_DTYPE": "float32"}


def compose(*args: str, timeout_s: float = 900) -> str:
    done = subprocess.run(
        [str(SCRIPT), *args], env=ENV, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise AssertionError(f"compose-local {' '.join(args)}: {done.stdout}\n{done.stderr}")
    return done.stdout


def podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], env=ENV, capture_output=True, text=True, check=True, timeout=120
    ).stdout


def containers(service: str) -> list[str]:
    """Names of the service's running containers."""
    out = podman(
        "ps",
        "--filter",
        "label=io.podman.compose.project=sluice",
        "--filter",
        f"label=io.podman.compose.service={service}",
        "--format",
        "{{.Names}}",
    )
    return sorted(out.split())


@pytest.fixture(scope="module")
def stack() -> Iterator[openai.OpenAI]:
    missing = [tool for tool in ("podman", "buildah", "debootstrap") if not shutil.which(tool)]
    if missing:
        service_missing(
            f"{', '.join(missing)} not installed (apt-get install podman buildah runc debootstrap)"
        )
    keep = os.environ.get("SLUICE_COMPOSE_KEEP") == "1"  # reuse a running stack, keep it
    if not keep:
        compose("down", timeout_s=300)
    try:
        compose("up", timeout_s=1500)
        Usage.ledger_before = ledger_totals()
        yield openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0, timeout=120)
    except BaseException:
        logs = subprocess.run(
            [str(SCRIPT), "compose", "logs", "--tail", "40"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(logs.stdout[-20000:], logs.stderr[-5000:])
        raise
    finally:
        if not keep:
            compose("down", timeout_s=300)


class Usage:
    """What the client was told it used, over every call of the module."""

    prompt = 0
    completion = 0
    ledger_before = (0, 0)  # a kept stack's earlier runs

    @classmethod
    def add(cls, prompt: int, completion: int) -> None:
        cls.prompt += prompt
        cls.completion += completion


def test_chat_stream_and_batch_through_the_gateway(stack: openai.OpenAI) -> None:
    text = check_chat(stack)
    usage = check_chat_stream(stack, text)
    # the plain call had the stream's prompt and 8 tokens (check_chat asserts them)
    Usage.add(usage.prompt_tokens, 8)
    Usage.add(usage.prompt_tokens, usage.completion_tokens)

    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "max_tokens": 6,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
            },
        }
        for i in range(3)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = stack.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = stack.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def ended() -> openai.types.Batch | None:
        got = stack.batches.retrieve(batch.id)
        return got if got.status in {"completed", "failed", "expired", "cancelled"} else None

    done = wait_until(ended, 300, f"batch {batch.id} to end", interval_s=1.0)
    assert done.status == "completed" and done.output_file_id
    out = [json.loads(x) for x in stack.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == [f"line-{i}" for i in range(3)]
    for line in out:
        body = line["response"]["body"]
        assert body["choices"][0]["message"]["content"]
        Usage.add(body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])


class Streamer(threading.Thread):
    """One greedy streaming completion; counts its chunks so the test knows it is running."""

    def __init__(self, client: openai.OpenAI, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.client, self.prompt = client, prompt
        self.text, self.chunks = "", 0
        self.usage: openai.types.CompletionUsage | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=MODEL,
                prompt=self.prompt,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
            for chunk in stream:
                self.usage = chunk.usage or self.usage
                self.text += "".join(choice.text for choice in chunk.choices)
                self.chunks += 1
        except BaseException as exc:
            self.error = exc


def host_pids(container: str) -> list[int]:
    return [int(pid) for pid in podman("top", container, "hpid").split()[1:]]


def cpu_ticks(pids: list[int]) -> int:
    """CPU time (clock ticks) these processes have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def test_a_killed_engine_container_loses_no_token(stack: openai.OpenAI) -> None:
    # one stream, alone on its engine both times: a greedy run's tokens depend on what else
    # shares its decode batch, so only an alone run is the reference of an alone run
    reply = stack.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert reply.usage is not None
    Usage.add(reply.usage.prompt_tokens, reply.usage.completion_tokens)
    alone = reply.choices[0].text

    compose("compose", "up", "-d", "--no-deps", "--no-recreate", "--scale", "engine=2", "engine")
    wait_until(lambda: len(containers("engine")) == 2, 120, "two engine containers")
    compose("wait", "300")
    engines = containers("engine")

    streamer = Streamer(stack, PROMPT)
    streamer.start()
    wait_until(lambda: streamer.chunks > 0 or streamer.error, 300, "the stream to start")
    # the engine that decodes it is the one burning CPU (the other only polls Kafka)
    pids = {c: host_pids(c) for c in engines}
    before = {c: cpu_ticks(pids[c]) for c in engines}

    def decoder() -> str | None:
        used = {c: cpu_ticks(pids[c]) - before[c] for c in engines}
        busy = max(used, key=lambda c: used[c])
        return busy if used[busy] >= 2 * min(used.values()) + 40 else None

    victim = wait_until(decoder, 120, "one engine to decode the stream", interval_s=0.05)
    assert streamer.is_alive(), f"the stream ended before the kill: {streamer.error!r}"
    podman("kill", "--signal", "KILL", victim)
    streamer.join(600)
    assert streamer.error is None
    assert streamer.usage is not None
    Usage.add(streamer.usage.prompt_tokens, streamer.usage.completion_tokens)
    assert streamer.usage.completion_tokens == MAX_TOKENS
    diverge = next(
        (i for i, (a, b) in enumerate(zip(streamer.text, alone, strict=False)) if a != b),
        min(len(streamer.text), len(alone)),
    )
    assert streamer.text == alone, (  # no gap, no repeat
        f"{len(streamer.text)} characters streamed, {len(alone)} alone, the first "
        f"difference at {diverge} of {streamer.chunks} chunks"
    )


def ledger_totals() -> tuple[int, int]:
    out = podman(
        "exec",
        containers("postgres")[0],
        "psql",
        "-U",
        "sluice",
        "-d",
        "sluice",
        "-tAc",
        "SELECT coalesce(sum(prompt_tokens), 0) || ' ' || coalesce(sum(completion_tokens), 0)"
        " FROM usage_ledger",
    )
    prompt, completion = out.split()
    return int(prompt), int(completion)


def test_the_ledger_equals_the_usage_after_a_billing_restart(stack: openai.OpenAI) -> None:
    compose("compose", "restart", "billing")
    compose("wait", "300")
    reply = stack.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "After the restart."}],
        max_tokens=5,
        temperature=0,
    )
    assert reply.usage is not None
    Usage.add(reply.usage.prompt_tokens, reply.usage.completion_tokens)
    before = Usage.ledger_before
    seen = (before[0] + Usage.prompt, before[1] + Usage.completion)
    wait_until(lambda: ledger_totals() == seen, 120, f"the ledger to reach {seen}", interval_s=1)
