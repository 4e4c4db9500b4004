"""OpenAI response objects for chat and (legacy) completions: chunks and whole answers.

Shapes follow the SDK's `chat_completion_chunk.py`, `chat_completion.py` and
`completion.py` (openai-python `types/`): every chunk carries `"usage": null` except the
`stream_options.include_usage` chunk, whose `choices` is `[]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.api.generation import ChoiceResult, Generation
from sluice.api.output import OutputPlan, Piece, read_whole, reasoning_tokens
from sluice.api.served import Tokenizer
from sluice.bus.messages import PromptLogprob, TokenLogprob

# finish reasons the OpenAI schema knows; the others end in an error before this point
_OPENAI_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _OPENAI_FINISH.get(reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def generation_usage(prompt_tokens: int, generation: Generation) -> dict[str, Any]:
    """The usage object of a whole call: the gateway's prompt count, what was delivered."""
    return usage(prompt_tokens, generation.num_completion_tokens, generation.num_cached_tokens)


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text, list(text.encode())


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for lp in logprobs:
        token, raw = _token(tokenizer, lp.token_id)
        top = []
        for alt in lp.top:
            alt_token, alt_raw = _token(tokenizer, alt.token_id)
            top.append({"token": alt_token, "logprob": alt.logprob, "bytes": alt_raw})
        content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """A choice's prompt for `echo` with logprobs: its token ids, their prompt logprobs
    (None first) and how many alternatives each shows (the request's `logprobs`)."""

    token_ids: list[int]
    logprobs: list[PromptLogprob | None]
    top: int


def completion_logprobs(
    tokenizer: Tokenizer,
    logprobs: list[TokenLogprob],
    text_offset: int,
    prompt: EchoedPrompt | None = None,
) -> dict[str, Any]:
    """The legacy logprobs object; with `prompt` (echo) its tokens come first, the first
    with null logprob and top_logprobs, as OpenAI and vLLM answer."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    if prompt is not None:
        for token_id, plp in zip(prompt.token_ids, prompt.logprobs, strict=True):
            token, _ = _token(tokenizer, token_id)
            tokens.append(token)
            token_logprobs.append(None if plp is None else plp.logprob)
            tops.append(
                None
                if plp is None
                else {_token(tokenizer, a.token_id)[0]: a.logprob for a in plp.top[: prompt.top]}
            )
            offsets.append(offset)
            offset += len(token)
    for lp in logprobs:
        token, _ = _token(tokenizer, lp.token_id)
        tokens.append(token)
        token_logprobs.append(lp.logprob)
        tops.append({_token(tokenizer, a.token_id)[0]: a.logprob for a in lp.top})
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, prompt: list[PromptLogprob | None], top: int
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None first) a dict from token id to its
    logprob, rank and text: the prompt token itself, then the `top` most likely."""
    out: list[dict[int, dict[str, Any]] | None] = []
    for plp in prompt:
        if plp is None:
            out.append(None)
            continue
        entry = {plp.token_id: _vllm_logprob(tokenizer, plp.token_id, plp.logprob, plp.rank)}
        for rank, alt in enumerate(plp.top[:top], start=1):
            if alt.token_id not in entry:
                entry[alt.token_id] = _vllm_logprob(tokenizer, alt.token_id, alt.logprob, rank)
        out.append(entry)
    return out


def _vllm_logprob(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": _token(tokenizer, token_id)[0]}


class _CallFormat:
    """What every object of one call shares: id, object names, created, model, tier."""

    id_prefix = ""
    chunk_object = ""
    whole_object = ""

    def __init__(
        self, call_id: str, model: str, created: int, tier: str, tokenizer: Tokenizer
    ) -> None:
        self.id = f"{self.id_prefix}{call_id}"
        self.model = model
        self.created = created
        self.tier = tier
        self.tokenizer = tokenizer

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "service_tier": self.tier,
            "system_fingerprint": None,
        }

    def usage_chunk(self, usage_obj: dict[str, Any]) -> dict[str, Any]:
        """The include_usage chunk: `choices: []` and the usage (OpenAI's shape)."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_obj}


class ChatFormat(_CallFormat):
    """chat.completion and chat.completion.chunk objects of one call."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    whole_object = "chat.completion"

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        want_logprobs: bool = False,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(self.tokenizer, logprobs or [])
            if want_logprobs and (logprobs or finish is None)
            else None,
            "finish_reason": finish_reason(finish),
        }
        return {**self._head(self.chunk_object), "choices": [choice], "usage": None}

    def delta(self, piece: Piece) -> dict[str, Any]:
        """A streamed piece of the output as a chunk's delta."""
        if piece.call is not None:
            call: dict[str, Any] = {"index": piece.call.index}
            if piece.call.id is not None:
                call.update(id=piece.call.id, type="function")
                call["function"] = {"name": piece.call.name, "arguments": piece.call.arguments}
            else:
                call["function"] = {"arguments": piece.call.arguments}
            return {"tool_calls": [call]}
        if piece.reasoning:
            return {"reasoning_content": piece.reasoning}
        return {"content": piece.content}

    def completion(
        self,
        results: list[ChoiceResult],
        usage_obj: dict[str, Any],
        want_logprobs: bool,
        plan: OutputPlan | None = None,
        prompt_logprobs: int | None = None,
    ) -> dict[str, Any]:
        """`prompt_logprobs`: vLLM's field of that name (the one prompt's, at the top
        level as vLLM puts it), with that many alternatives."""
        plan = plan or OutputPlan()
        choices, readers = [], []
        for r in results:
            message: dict[str, Any] = {"role": "assistant", "content": r.text, "refusal": None}
            finish = finish_reason(r.finish_reason)
            if not plan.plain:
                reader = read_whole(plan, r.text)
                readers.append(reader)
                message["content"] = reader.content
                if reader.calls:
                    message["tool_calls"] = [c.openai() for c in reader.calls]
                    finish = "tool_calls" if finish == "stop" else finish
                if plan.reasoning:
                    message["reasoning_content"] = reader.reasoning
            choices.append(
                {
                    "index": r.index,
                    "message": message,
                    "logprobs": chat_logprobs(self.tokenizer, r.logprobs)
                    if want_logprobs
                    else None,
                    "finish_reason": finish,
                }
            )
        if plan.reasoning:
            usage_obj = with_reasoning_tokens(usage_obj, reasoning_tokens(self.tokenizer, readers))
        answer = {**self._head(self.whole_object), "choices": choices, "usage": usage_obj}
        if prompt_logprobs is not None:
            prompt = next((r.prompt_logprobs for r in results if r.prompt_logprobs), None)
            answer["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tokenizer, prompt or [], prompt_logprobs
            )
        return answer


def with_reasoning_tokens(usage_obj: dict[str, Any], count: int) -> dict[str, Any]:
    return {**usage_obj, "completion_tokens_details": {"reasoning_tokens": count}}


class CompletionFormat(_CallFormat):
    """text_completion objects (whole and streamed) of one call."""

    id_prefix = "cmpl-"
    chunk_object = whole_object = "text_completion"

    def chunk(
        self,
        index: int,
        text: str,
        finish: str | None,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        want_logprobs: bool,
        token_ids: list[int] | None = None,
        prompt: EchoedPrompt | None = None,
    ) -> dict[str, Any]:
        """One choice's chunk; `token_ids` (vLLM's `return_token_ids`) only when given;
        `prompt`: the echoed prompt's logprobs, before the chunk's own."""
        lp = (
            completion_logprobs(self.tokenizer, logprobs or [], text_offset, prompt)
            if want_logprobs
            else None
        )
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish_reason(finish),
        }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head(self.chunk_object), "choices": [choice], "usage": None}

    def completion(
        self,
        results: list[ChoiceResult],
        usage_obj: dict[str, Any],
        want_logprobs: bool,
        want_token_ids: bool = False,
        echo: list[str] | None = None,
        prompts: list[list[int]] | None = None,
        top: int = 0,
        prompt_logprobs: int | None = None,
    ) -> dict[str, Any]:
        """`echo`: each choice's prompt text, put before its output; with `prompts` (each
        choice's prompt token ids) its logprobs too, `top` alternatives each.
        `prompt_logprobs`: vLLM's field of that name on each choice, with that many."""
        choices = []
        for r in results:
            echoed = None
            if echo and prompts and r.prompt_logprobs is not None:
                echoed = EchoedPrompt(prompts[r.index], r.prompt_logprobs, top)
            choice: dict[str, Any] = {
                "index": r.index,
                "text": (echo[r.index] if echo else "") + r.text,
                "logprobs": completion_logprobs(self.tokenizer, r.logprobs, 0, echoed)
                if want_logprobs
                else None,
                "finish_reason": finish_reason(r.finish_reason),
            }
            if want_token_ids:
                choice["token_ids"] = r.token_ids
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    self.tokenizer, r.prompt_logprobs or [], prompt_logprobs
                )
            choices.append(choice)
        return {**self._head(self.whole_object), "choices": choices, "usage": usage_obj}
