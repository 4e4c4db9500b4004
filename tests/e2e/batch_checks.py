"""Batch API checks shared by the embedded and Kafka end-to-end tests (official SDK)."""

from __future__ import annotations

import io
import json
from typing import Any

import openai
from openai.types import Batch

from tests.e2e.procs import API_KEY
from tests.e2e.sdk_checks import MODEL
from tests.waiting import wait_until

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def chat_line(custom_id: str, content: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def sdk_client(base: str, api_key: str = API_KEY) -> openai.OpenAI:
    """The SDK's client for the server at `base`, without retries (a test sees every error)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)


def jsonl(lines: list[dict[str, Any]] | list[str]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def submit(client: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions") -> Batch:
    file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(
        input_file_id=file.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"test": "e2e"},
    )


def wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 180.0) -> Batch:
    def ended() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in TERMINAL else None

    return wait_until(ended, timeout_s, f"batch {batch_id} to end", interval_s=0.3)


def wait_for_progress(client: openai.OpenAI, batch_id: str, done: int) -> Batch:
    """Until at least `done` lines finished (or the batch ended)."""

    def progressed() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        if batch.status in TERMINAL or (counts and counts.completed + counts.failed >= done):
            return batch
        return None

    return wait_until(progressed, 120, f"{done} lines of batch {batch_id}", interval_s=0.1)


def results(
    client: openai.OpenAI, batch: Batch
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(output lines, error lines) of a finished batch."""
    out: list[dict[str, Any]] = []
    err: list[dict[str, Any]] = []
    if batch.output_file_id:
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    if batch.error_file_id:
        err = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    return out, err


def check_each_once(
    lines: list[dict[str, Any]], out: list[dict[str, Any]], err: list[dict[str, Any]]
) -> None:
    """Every custom_id of the input exactly once across the output and error files."""
    seen = [x["custom_id"] for x in out + err]
    assert sorted(seen) == sorted(line["custom_id"] for line in lines), (len(seen), len(lines))


def content_of(line: dict[str, Any]) -> str:
    body = line["response"]["body"]
    if body.get("object") == "chat.completion":
        return str(body["choices"][0]["message"]["content"])
    if body.get("object") == "text_completion":
        return str(body["choices"][0]["text"])
    return str(body["output"][0]["content"][0]["text"])


def answer_alone(client: openai.OpenAI, body: dict[str, Any]) -> str | None:
    """A chat line's body sent on its own (the SDK takes Sluice's extras in extra_body)."""
    body = dict(body)
    extra = {"ignore_eos": body.pop("ignore_eos")} if "ignore_eos" in body else None
    return client.chat.completions.create(**body, extra_body=extra).choices[0].message.content


def unlike_alone(
    client: openai.OpenAI, lines: list[dict[str, Any]], out: list[dict[str, Any]]
) -> list[str]:
    """The custom_ids of the chat lines whose output differs from their body sent alone
    (`out` in the order of `lines`)."""
    return [
        line["custom_id"]
        for line, result in zip(lines, out, strict=True)
        if content_of(result) != answer_alone(client, line["body"])
    ]


def usage_in_files(out: list[dict[str, Any]], err: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt, completion) tokens summed over a batch's output and error lines."""
    prompt = completion = 0
    for line in out + err:
        usage = (line["response"] or {}).get("body", {}).get("usage")
        if usage is not None:
            prompt += usage["prompt_tokens"]
            completion += usage["completion_tokens"]
    return prompt, completion
