"""Prompt and output text for the server span, only where `trace_content` opts in.

Off by default: no prompt or completion goes into a span unless the operator asks
(`SLUICE_TRACE_CONTENT=true`). When on, the middleware keeps the first
`CONTENT_LIMIT_BYTES` of the request and response bodies as they pass and, when the
response is done, reads them as the GenAI conventions' `gen_ai.input.messages` and
`gen_ai.output.messages` (JSON strings). Bodies are read as sent, so the routes need
no hook; anything past the limit or not understood is left out, never an error.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Message, Receive, Send

CONTENT_LIMIT_BYTES = 64 * 1024
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"


class ContentCapture:
    """The start of one request's and one response's bodies, kept as they pass."""

    def __init__(self) -> None:
        self.request = bytearray()
        self.response = bytearray()
        self.streamed = False

    def wrap(self, receive: Receive, send: Send) -> tuple[Receive, Send]:
        async def receive_kept() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                _keep(self.request, message.get("body", b""))
            return message

        async def send_kept(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                self.streamed = b"text/event-stream" in headers.get(b"content-type", b"")
            elif message["type"] == "http.response.body":
                _keep(self.response, message.get("body", b""))
            await send(message)

        return receive_kept, send_kept

    def attributes(self) -> dict[str, str]:
        out: dict[str, str] = {}
        inputs = _input_messages(_json(bytes(self.request)))
        if inputs:
            out[INPUT_MESSAGES] = json.dumps(inputs)
        texts = _streamed_texts(bytes(self.response)) if self.streamed else None
        if texts is None and not self.streamed:
            texts = _answer_texts(_json(bytes(self.response)))
        if texts:
            out[OUTPUT_MESSAGES] = json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": t}]} for t in texts]
            )
        return out


def _keep(buffer: bytearray, body: bytes) -> None:
    room = CONTENT_LIMIT_BYTES - len(buffer)
    if room > 0:
        buffer += body[:room]


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _text_part(content: Any) -> dict[str, Any]:
    return {"type": "text", "content": content if isinstance(content, str) else json.dumps(content)}


def _input_messages(body: Any) -> list[dict[str, Any]]:
    """Chat `messages`, a completion's `prompt`, or a response's `input`, as messages."""
    if not isinstance(body, dict):
        return []
    messages = body.get("messages")
    if isinstance(messages, list):
        return [
            {"role": str(m.get("role")), "parts": [_text_part(m.get("content"))]}
            for m in messages
            if isinstance(m, dict)
        ]
    prompt = body.get("prompt", body.get("input"))
    return [] if prompt is None else [{"role": "user", "parts": [_text_part(prompt)]}]


def _choice_text(choice: dict[str, Any]) -> str:
    for part in (choice.get("delta"), choice.get("message")):
        if isinstance(part, dict) and isinstance(part.get("content"), str):
            return str(part["content"])
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _answer_texts(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return []
    if isinstance(body.get("choices"), list):
        return [_choice_text(c) for c in body["choices"] if isinstance(c, dict)]
    text = body.get("output_text")
    return [text] if isinstance(text, str) else []


def _streamed_texts(raw: bytes) -> list[str]:
    """Each choice's text from the `data:` events of an SSE body (chat, completions, or
    the Responses API's `response.output_text.delta`)."""
    texts: dict[int, str] = {}
    for line in raw.decode(errors="replace").splitlines():
        event = _json(line.removeprefix("data: ").encode()) if line.startswith("data: {") else None
        if not isinstance(event, dict):
            continue
        if event.get("type") == "response.output_text.delta":
            texts[0] = texts.get(0, "") + str(event.get("delta", ""))
        for choice in event.get("choices") or []:
            if isinstance(choice, dict):
                index = int(choice.get("index", 0))
                texts[index] = texts.get(index, "") + _choice_text(choice)
    return [texts[i] for i in sorted(texts)]
