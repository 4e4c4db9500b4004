"""The sim backend refuses structured outputs (its tokens are stand-ins no grammar holds)
and prompt logprobs (it has no logits)."""

from __future__ import annotations

import pytest

from sluice.engine.backends.base import EngineRequest, RequestRejectedError
from sluice.engine.backends.sim_backend import SimEngineBackend
from sluice.engine.sampling import Constraint, SamplingParams


def test_constrained_requests_are_refused() -> None:
    backend = SimEngineBackend("h200-llama3.1-8b-fp8", vocab_size=1000)
    params = SamplingParams(constraint=Constraint("json_object"))
    with pytest.raises(RequestRejectedError, match="structured"):
        backend.submit(EngineRequest("r", [1, 2, 3], params))


def test_prompt_logprobs_are_refused() -> None:
    backend = SimEngineBackend("h200-llama3.1-8b-fp8", vocab_size=1000)
    with pytest.raises(RequestRejectedError, match="prompt_logprobs"):
        backend.submit(EngineRequest("r", [1, 2, 3], SamplingParams(prompt_logprobs=1)))
