"""The Responses API: the `response` object and its stream of events.

One generation becomes output items, read by `api.output.ChoiceReader`: a `reasoning`
item (with a reasoning parser), an assistant `message` with one `output_text` part, and a
`function_call` item per tool call. The events are those of OpenAI's Responses
streaming, shared by SSE (`event:` + `data:`) and the WebSocket mode: response.created,
response.in_progress, then per item response.output_item.added, its own deltas
(response.content_part.added, response.output_text.delta…, .done,
response.content_part.done; response.reasoning_text.delta…, .done;
response.function_call_arguments.delta…, .done) and response.output_item.done, then
response.completed, response.incomplete (max_output_tokens), response.failed, or for a
background response cancelled while it ran response.cancelled (status "cancelled"). A plain
answer opens its message at once; with tools or reasoning an item opens when its first
text arrives, and an answer with no item at all gets an empty message.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sluice.api.errors import APIError, InvalidRequest, error_for_finish
from sluice.api.generation import ChoiceResult, Generation
from sluice.api.output import ChoiceReader, OutputPlan, Piece
from sluice.api.schemas import ResponsesRequest
from sluice.api.served import Tokenizer
from sluice.api.streaming import pump


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
        self,
        call_id: str,
        body: ResponsesRequest,
        tier: str,
        num_prompt_tokens: int,
        plan: OutputPlan | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        stored: bool = False,
    ) -> None:
        self.call_id = call_id
        self.id = f"resp_{call_id}"
        self.item_id = f"msg_{call_id}"
        self.body = body
        self.tier = tier
        self.num_prompt_tokens = num_prompt_tokens
        self.plan = plan or OutputPlan()
        self.tokenizer = tokenizer  # counts reasoning tokens
        self.created_at = int(time.time())
        self.stored = stored  # kept in the response store (`store`, `background`)
        self._seq = 0

    # -- objects --------------------------------------------------------------------
    def usage(
        self, output_tokens: int, cached_tokens: int, reasoning: str | None = None
    ) -> dict[str, Any]:
        reasoning_tokens = 0
        if reasoning and self.tokenizer is not None:
            reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False))
        return {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": self.num_prompt_tokens + output_tokens,
        }

    def message(self, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        return {
            "id": item_id or self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self.part(text)],
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {
            "id": f"rs_{self.call_id}",
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }

    def call_item(
        self, index: int, call_id: str, name: str, arguments: str, status: str
    ) -> dict[str, Any]:
        return {
            "id": f"fc_{self.call_id}_{index}",
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        error: APIError | None = None,
    ) -> dict[str, Any]:
        body = self.body
        text_format = (body.text or {}).get("format") or {"type": "text"}
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
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "service_tier": self.tier,
            "store": self.stored,
            "background": bool(body.background),
            "temperature": body.temperature,
            "text": {"format": text_format},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def output_items(
        self, reader: ChoiceReader | None, text: str, status: str
    ) -> list[dict[str, Any]]:
        """A whole answer's items: reasoning, the message (if any text), the calls."""
        if reader is None:
            return [self.message(text, status)]
        items = []
        if reader.reasoning is not None:
            items.append(self.reasoning_item(reader.reasoning, "completed"))
        if reader.content or not reader.calls:
            items.append(self.message(reader.content or "", status))
        for i, call in enumerate(reader.calls):
            items.append(self.call_item(i, call.id, call.name, call.arguments, "completed"))
        return items

    def final(self, result: ChoiceResult, output_tokens: int, cached: int) -> dict[str, Any]:
        """The whole answer of a non-streaming call (errors were raised before)."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        reader = None
        if not self.plan.plain:
            reader = ChoiceReader(self.plan)
            reader.feed(result.text)
            reader.finish()
        items = self.output_items(reader, result.text, status)
        reasoning = reader.reasoning if reader is not None else None
        return self.response(status, items, self.usage(output_tokens, cached, reasoning))

    # -- events ---------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    async def events(
        self,
        generation: Generation,
        ping_s: float,
        cancelled: Callable[[], bool] | None = None,
    ) -> AsyncIterator[dict[str, Any] | None]:
        """Stream events of one generation; None when a keep-alive is due. `cancelled`
        says whether an abort is a cancel the client asked for (a background response):
        the stream then ends with response.cancelled, its output as far as it got."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        items = _ItemStream(self)
        reader = ChoiceReader(self.plan)
        if self.plan.plain:
            for event in items.open_message():
                yield event
        finish, detail, code = None, None, None
        async for ev in pump(generation, ping_s):
            if ev is None:
                yield None
                continue
            pieces = reader.feed(ev.text) if ev.text else []
            if ev.finish_reason is not None:
                finish, detail, code = ev.finish_reason, ev.error, ev.error_code
                pieces += reader.finish()
            for piece in pieces:
                for event in items.piece(piece):
                    yield event
        if finish == "abort" and cancelled is not None and cancelled():
            for event in items.close("incomplete", final=True):
                yield event
            usage = self.usage(
                generation.num_completion_tokens, generation.num_cached_tokens, reader.reasoning
            )
            final = self.response("cancelled", items.done, usage)
            yield self.event("response.cancelled", response=final)
            return
        error = error_for_finish(finish or "error", detail, code)
        if finish is None:
            error = error or APIError("the stream ended without a finish")
        if error is not None:
            yield self.event("response.failed", response=self.response("failed", error=error))
            return
        status = "incomplete" if finish == "length" else "completed"
        for event in items.close(status, final=True):
            yield event
        usage = self.usage(
            generation.num_completion_tokens, generation.num_cached_tokens, reader.reasoning
        )
        yield self.event(f"response.{status}", response=self.response(status, items.done, usage))


class _ItemStream:
    """The output items of a stream as they open, grow and close."""

    def __init__(self, fmt: ResponsesFormat) -> None:
        self.fmt = fmt
        self.done: list[dict[str, Any]] = []
        self._open: str | None = None  # reasoning | message | call
        self._text = ""
        self._messages = 0
        self._item_id = ""
        self._call: dict[str, Any] = {}

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        fmt, out = self.fmt, []
        if piece.reasoning:
            if self._open != "reasoning":
                out += self.close("completed")
                self._open, self._text = "reasoning", ""
                self._item_id = f"rs_{fmt.call_id}"
                out.append(self._added(fmt.reasoning_item("", "in_progress")))
            self._text += piece.reasoning
            out.append(self._delta("response.reasoning_text.delta", piece.reasoning))
        elif piece.call is not None:
            call = piece.call
            if call.id is not None:
                out += self.close("completed")
                self._open, self._text = "call", ""
                item = fmt.call_item(call.index, call.id, call.name or "", "", "in_progress")
                self._call, self._item_id = item, item["id"]
                out.append(self._added(item))
            if call.arguments:
                self._text += call.arguments
                out.append(
                    fmt.event(
                        "response.function_call_arguments.delta",
                        item_id=self._item_id,
                        output_index=len(self.done),
                        delta=call.arguments,
                    )
                )
        elif piece.content:
            if self._open != "message":
                out += self.close("completed")
                out += self.open_message()
            self._text += piece.content
            out.append(self._delta("response.output_text.delta", piece.content, logprobs=[]))
        return out

    def open_message(self) -> list[dict[str, Any]]:
        fmt = self.fmt
        self._item_id = fmt.item_id if not self._messages else f"{fmt.item_id}_{self._messages}"
        self._messages += 1
        self._open, self._text = "message", ""
        item = {**fmt.message("", "in_progress", self._item_id), "content": []}
        return [
            self._added(item),
            fmt.event(
                "response.content_part.added",
                item_id=self._item_id,
                output_index=len(self.done),
                content_index=0,
                part=fmt.part(""),
            ),
        ]

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        return self.fmt.event("response.output_item.added", output_index=len(self.done), item=item)

    def _delta(self, kind: str, delta: str, **extra: Any) -> dict[str, Any]:
        return self.fmt.event(
            kind,
            item_id=self._item_id,
            output_index=len(self.done),
            content_index=0,
            delta=delta,
            **extra,
        )

    def close(self, status: str, final: bool = False) -> list[dict[str, Any]]:
        """Close the open item (`final`: the stream's end, which has at least a message)."""
        fmt, out = self.fmt, []
        if final and self._open is None and not self.done:
            out += self.open_message()
        at = {"item_id": self._item_id, "output_index": len(self.done)}
        text, kind = self._text, self._open
        if kind == "message":
            out.append(
                fmt.event(
                    "response.output_text.done", **at, content_index=0, text=text, logprobs=[]
                )
            )
            out.append(
                fmt.event("response.content_part.done", **at, content_index=0, part=fmt.part(text))
            )
            item = fmt.message(text, status, self._item_id)
        elif kind == "reasoning":
            out.append(fmt.event("response.reasoning_text.done", **at, content_index=0, text=text))
            item = fmt.reasoning_item(text, "completed")
        elif kind == "call":
            call = self._call
            out.append(
                fmt.event(
                    "response.function_call_arguments.done",
                    **at,
                    name=call["name"],
                    arguments=text,
                )
            )
            item = {**call, "arguments": text, "status": "completed"}
        else:
            return out
        out.append(fmt.event("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self._open = None
        return out


# -- stored input (input_items, previous_response_id) -------------------------------------
def input_items(body: ResponsesRequest, call_id: str) -> list[dict[str, Any]]:
    """The request's input as the items `GET /v1/responses/{id}/input_items` lists: a
    string is one user message; each item gets an id when it has none."""
    if isinstance(body.input, str):
        part = {"type": "input_text", "text": body.input}
        message = {"type": "message", "role": "user", "content": [part]}
        return [{"id": f"msg_{call_id}_in0", **message, "status": "completed"}]
    items = []
    for i, item in enumerate(body.input):
        value = item.model_dump(exclude_none=True)
        value.setdefault("id", f"item_{call_id}_in{i}")
        items.append(value)
    return items


def as_input(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input or output item in the shape a request's `input` takes (for
    `previous_response_id`): ids, statuses and annotations dropped."""
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = [{"type": p.get("type"), "text": p.get("text", "")} for p in content]
        return {"type": "message", "role": item.get("role"), "content": content}
    keys: tuple[str, ...]
    if kind == "function_call":
        keys = ("type", "call_id", "name", "arguments")
    elif kind == "function_call_output":
        keys = ("type", "call_id", "output")
    else:
        keys = ("type",)
    return {k: item[k] for k in keys if k in item}
