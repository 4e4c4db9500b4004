"""The sim engine backend as the consumers' tests run it, and the reply it gives.

`RecordingSimBackend` is the project's `SimEngineBackend` (it passes the backend
contract) with fast, flat steps, a running limit, and a log of what the worker submitted
and aborted. `sim_reply` is the oracle: the tokens and text a greedy request gets, from
a `SimCore` of the same shape stepped here (the sim's reply depends on the prompt only).
A request resumed with prompt + generated tokens does not continue the sim's reply; the
failover and restart tests run on `engine_fakes.FakeEngineBackend`, whose does.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.backends.base import EngineRequest
from sluice.engine.backends.sim.core import SimCore
from sluice.engine.backends.sim.presets import SimPreset
from sluice.engine.backends.sim_backend import SimEngineBackend
from sluice.engine.sampling import SamplingParams

VOCAB = 1000  # prompts in these tests use ids below it
MAX_MODEL_LEN = 4096

PRESET = SimPreset(
    name="consumer-tests",
    base_ms=5.0,  # every step takes the same time, whatever it holds
    per_seq_us=0.0,
    per_token_us=0.0,
    per_kv_token_ns=0.0,
    per_pair_ps=0.0,
    num_kv_blocks=4096,
    max_num_seqs=8,
    max_num_batched_tokens=8192,
    max_model_len=MAX_MODEL_LEN,
)


class RecordingSimBackend(SimEngineBackend):
    """The sim, stepping every `step_s` with at most `max_running` requests running;
    `submitted` and `aborts` log the worker's calls in order."""

    def __init__(self, step_s: float = 0.005, max_running: int = 8) -> None:
        preset = PRESET.replace(base_ms=step_s * 1e3, max_num_seqs=max_running)
        super().__init__(preset, vocab_size=VOCAB)
        self.submitted: list[EngineRequest] = []
        self.aborts: list[str] = []

    def submit(self, request: EngineRequest) -> None:
        super().submit(request)
        self.submitted.append(request)

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        super().abort(request_id)


def sim_reply(prompt: Sequence[int], max_tokens: int) -> tuple[list[int], str]:
    """The token ids and text the sim answers a greedy request for `prompt` with."""
    core = SimCore(PRESET, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    core.add(EngineRequest("oracle", list(prompt), params))
    token_ids: list[int] = []
    text = ""
    while core.has_unfinished():
        for delta in core.finish_step(core.schedule()):
            token_ids += delta.token_ids
            text += delta.text
    return token_ids, text
