"""The Responses API (text): the `response` object and its stream of events.

One generation becomes one assistant message with one `output_text` part. The events
are those of OpenAI's Responses streaming, shared by SSE (`event:` + `data:`) and the
WebSocket mode: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta…, response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed,
response.incomplete (max_output_tokens) or response.failed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from api.errors import APIError, InvalidRequest, error_for_finish
from api.generation import ChoiceResult, Generation
from api.schemas import ResponsesRequest
from api.streaming import pump


def text_format_type(text: dict[str, Any] | None) -> str:
    """The `text.format.type` a request asks for, "text" when it names none.

    The schema keeps `text` an open object (OpenAI adds fields to it), so its `format`
    is checked here: anything but an object is the client's error, a 400.
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return "text"
    if not isinstance(fmt, dict):
        raise InvalidRequest(
            'text.format must be an object such as {"type": "text"}',
            param="text.format",
            code="invalid_type",
        )
    kind = fmt.get("type", "text")
    if not isinstance(kind, str):
        raise InvalidRequest(
            "text.format.type must be a string", param="text.format.type", code="invalid_type"
        )
    return kind


class ResponsesFormat:
    def __init__(
        self, call_id: str, body: ResponsesRequest, tier: str, num_prompt_tokens: int
    ) -> None:
        self.id = f"resp_{call_id}"
        self.item_id = f"msg_{call_id}"
        self.body = body
        self.tier = tier
        self.num_prompt_tokens = num_prompt_tokens
        self.created_at = int(time.time())
        self._seq = 0

    # -- objects --------------------------------------------------------------------
    def usage(self, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.num_prompt_tokens + output_tokens,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self.part(text)],
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        error: APIError | None = None,
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None if error is None else {"code": error.code, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": output or [],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": self.tier,
            "store": False,
            "temperature": body.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def final(self, result: ChoiceResult, output_tokens: int, cached: int) -> dict[str, Any]:
        """The whole answer of a non-streaming call (errors were raised before)."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        return self.response(
            status, [self.message(result.text, status)], self.usage(output_tokens, cached)
        )

    # -- events ---------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    async def events(
        self, generation: Generation, ping_s: float
    ) -> AsyncIterator[dict[str, Any] | None]:
        """Stream events of one generation; None when a keep-alive is due."""
        at = {"item_id": self.item_id, "output_index": 0}
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        yield self.event(
            "response.output_item.added",
            output_index=0,
            item={**self.message("", "in_progress"), "content": []},
        )
        yield self.event("response.content_part.added", **at, content_index=0, part=self.part(""))
        text, finish, detail = "", None, None
        async for ev in pump(generation, ping_s):
            if ev is None:
                yield None
                continue
            if ev.text:
                text += ev.text
                yield self.event(
                    "response.output_text.delta", **at, content_index=0, delta=ev.text, logprobs=[]
                )
            if ev.finish_reason is not None:
                finish, detail = ev.finish_reason, ev.error
        error = error_for_finish(finish or "error", detail)
        if finish is None:
            error = error or APIError("the stream ended without a finish")
        if error is not None:
            yield self.event("response.failed", response=self.response("failed", error=error))
            return
        status = "incomplete" if finish == "length" else "completed"
        usage = self.usage(generation.num_completion_tokens, generation.num_cached_tokens)
        yield self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
        yield self.event("response.content_part.done", **at, content_index=0, part=self.part(text))
        item = self.message(text, status)
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event(f"response.{status}", response=self.response(status, [item], usage))
