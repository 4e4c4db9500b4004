"""Request bodies of the OpenAI-compatible routes (pydantic at the HTTP edge).

Fields the OpenAI SDK sends that Sluice has no use for (`metadata`, `user`, `store`,
`parallel_tool_calls`, `safety_identifier`, `prompt_cache_key`, ...) are accepted and
ignored; unknown fields are ignored too, as the SDK's own forward-compatible fields
would otherwise break clients. Parameters that would change the output and that Sluice
cannot honour are refused by `api.prepare` with a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ServiceTier = Literal["auto", "default", "flex", "priority", "scale", "fast"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Sampling(_Body):
    """Sampling fields shared by chat and completions (plus vLLM's common extras)."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: ServiceTier | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class ResponseInputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponseInputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponseInputText]


class ResponsesRequest(_Body):
    """`POST /v1/responses` and the WebSocket `response.create` event (text only)."""

    model: str
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0)
    stream: bool = False
    service_tier: ServiceTier | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_id: str | None = None  # WebSocket mode: the lane the events carry back
