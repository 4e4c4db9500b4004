"""Request bodies of the OpenAI-compatible routes (pydantic at the HTTP edge).

Fields the OpenAI SDK sends that Sluice has no use for (`metadata`, `user`, `store`,
`safety_identifier`, `prompt_cache_key`, ...) are accepted and
ignored; unknown fields are ignored too, as the SDK's own forward-compatible fields
would otherwise break clients. Parameters that would change the output and that Sluice
cannot honour are refused by `api.prepare` with a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

ServiceTier = Literal["auto", "default", "flex", "priority", "scale", "fast"]


# Seeds travel as signed 64-bit integers (what torch.Generator and the wire take).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# Token ids are JSON integers: pydantic would take `true` as 1 and `2.0` as 2.
TokenIds = list[StrictInt]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def invalid_unicode_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string holding a lone surrogate, or None.

    JSON's `\\ud800` escapes decode to Python strings that cannot be encoded as UTF-8;
    they would fail later, in the tokenizer or on the bus, after admission.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = invalid_unicode_at(key, path) or invalid_unicode_at(
                item, f"{path}.{key}" if path else str(key)
            )
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := invalid_unicode_at(item, f"{path}[{i}]"):
                return found
    return None


class RequestBody(_Body):
    """A whole request body: its strings must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (where := invalid_unicode_at(data)) is not None:
            raise ValueError(f"{where} is not valid Unicode (it holds a lone surrogate)")
        return data


class StreamOptions(_Body):
    # strict: pydantic would read "yes", "off" or 0 as booleans
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None


class _Sampling(RequestBody):
    """Sampling fields shared by chat and completions (plus vLLM's common extras)."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's; only 0 is served
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
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
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's
    # vLLM's output constraints (`api.structured`): one of them, or response_format
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (`api.tools`)
    tool_call_id: str | None = None  # a tool result's call


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
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    # vLLM's extension: each choice (and each streamed chunk's) carries its `token_ids`
    return_token_ids: bool = False
    response_format: dict[str, Any] | None = None  # vLLM's, as chat's

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One message naming `prompt`, instead of one error per member of the union."""
        if isinstance(value, str) or (
            isinstance(value, list)
            and (
                all(isinstance(p, str) for p in value)
                or _token_ids(value)
                or all(_token_ids(p) for p in value)
            )
        ):
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids (integers), "
            "or a list of token id lists"
        )


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)  # bool is an int


class ResponseInputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponseInputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponseInputText]


class ResponseFunctionCall(_Body):
    """A call the model made earlier, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponseInputText]


class ResponseReasoningInput(_Body):
    """A reasoning item of an earlier output, sent back: not rendered again."""

    type: Literal["reasoning"]


ResponseInputItem = (
    ResponseInputMessage
    | ResponseFunctionCall
    | ResponseFunctionCallOutput
    | ResponseReasoningInput
)


class ResponsesRequest(RequestBody):
    """`POST /v1/responses` and the WebSocket `response.create` event (text, function
    tools)."""

    model: str
    input: str | list[ResponseInputItem]
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

    @field_validator("input")
    @classmethod
    def _input_not_empty(
        cls, value: str | list[ResponseInputItem]
    ) -> str | list[ResponseInputItem]:
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one message")
        return value
