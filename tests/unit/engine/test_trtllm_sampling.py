"""The trtllm backend maps penalties and structured outputs to TensorRT-LLM's
SamplingParams and GuidedDecodingParams, and refuses what that API cannot express."""

from __future__ import annotations

import json
import re
import sys
import types
from typing import Any

import pytest

from sluice.engine.backends.base import EngineRequest, RequestRejectedError
from sluice.engine.backends.trtllm_backend import TrtllmEngineBackend, guided_kwargs
from sluice.engine.sampling import Constraint, SamplingParams


class Recorded:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> TrtllmEngineBackend:
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.GuidedDecodingParams = Recorded  # type: ignore[attr-defined]
    package = types.ModuleType("tensorrt_llm")
    package.llmapi = llmapi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    b = TrtllmEngineBackend(
        "unused", max_model_len=128, vocab_size=100, guided_decoding_backend="llguidance"
    )
    b._sampling_params = Recorded
    return b


def kwargs(backend: TrtllmEngineBackend, params: SamplingParams) -> dict[str, Any]:
    request = EngineRequest("r", [1, 2, 3], params)
    backend._check_supported(request)
    return backend._to_sampling_params(request).kwargs  # type: ignore[no-any-return]


def test_penalties_travel_only_when_set(backend: TrtllmEngineBackend) -> None:
    plain = kwargs(backend, SamplingParams())
    assert not {"frequency_penalty", "presence_penalty", "repetition_penalty"} & set(plain)
    set_ = kwargs(
        backend,
        SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2),
    )
    assert (set_["frequency_penalty"], set_["presence_penalty"], set_["repetition_penalty"]) == (
        0.5,
        -1.0,
        1.2,
    )


def test_constraints_become_guided_decoding(backend: TrtllmEngineBackend) -> None:
    schema = json.dumps({"type": "object"})
    guided = kwargs(backend, SamplingParams(constraint=Constraint("json_schema", schema)))
    assert guided["guided_decoding"].kwargs == {"json": schema}
    assert guided_kwargs(Constraint("json_object")) == {"json_object": True}
    assert guided_kwargs(Constraint("regex", "a+")) == {"regex": "a+"}
    assert guided_kwargs(Constraint("grammar", 'start: "x"')) == {"grammar": 'start: "x"'}
    choices = ["a.b", "(c)|d", "e f"]
    pattern = guided_kwargs(Constraint("choice", json.dumps(choices)))["regex"]
    for choice in choices:
        assert re.fullmatch(pattern, choice)
    assert not re.fullmatch(pattern, "aXb")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logit_bias={1: 1.0}),
        SamplingParams(prompt_logprobs=1),
        SamplingParams(constraint=Constraint("regex", "a", after="</think>")),
    ],
)
def test_what_the_api_cannot_express_is_refused(
    backend: TrtllmEngineBackend, params: SamplingParams
) -> None:
    with pytest.raises(RequestRejectedError):
        backend._check_supported(EngineRequest("r", [1], params))


def test_no_guided_backend_refuses_constraints() -> None:
    b = TrtllmEngineBackend("unused", max_model_len=128, vocab_size=100)
    with pytest.raises(RequestRejectedError, match="guided"):
        b._check_supported(
            EngineRequest("r", [1], SamplingParams(constraint=Constraint("json_object")))
        )
