"""Every message that crosses the engine-process boundary (`ProcessEngineBackend`).

What the parent sends the engine process to start it (`EngineSpec`), the commands down
its command pipe and the events up its event pipe. Each is a frozen dataclass, pickled
as it crosses; both ends dispatch on the message's type. Commands are imperative, events
past tense or a state (as on the bus, `bus/messages.py`):

    parent ─ EngineSpec ─────────────────────────────▶ engine process (spawn argument)
    parent ◀─ EngineReady | StartFailed ────────────── once, after loading the model
    parent ─ AddRequest | AbortRequest | StopEngine ─▶ the command pipe
    parent ◀─ StepCompleted* then EngineStopped ────── the event pipe, one per step

No torch here: the parent side reads this module without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sluice.engine.backends.base import EngineDelta, EngineRequest, EngineStats
from sluice.engine.config import EngineConfig
from sluice.engine.options import EngineOptions


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine process loads (`TorchEngineBackend.from_model`'s arguments) and
    how it runs: `options` apply to the whole engine process (its cores, torch threads,
    kernels) and its engine thread (nice value)."""

    model: str | Path
    config: EngineConfig
    data_dir: str | Path | None = None
    quantization: str | None = None
    options: EngineOptions = field(default_factory=EngineOptions)


# -- commands: parent → engine process ------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue `request` in the engine (already checked by the parent's `submit`)."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Cancel a request; an unknown or finished id is ignored."""

    request_id: str


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Shut the engine down: what it holds ends with 'abort', then `EngineStopped`."""


Command = AddRequest | AbortRequest | StopEngine


# -- events: engine process → parent --------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The model is loaded: the limits the parent's `submit` checks, and the first stats."""

    config: EngineConfig
    vocab_size: int | None
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The engine process could not load its model; it exits after sending this."""

    error: str


@dataclass(frozen=True, slots=True)
class StepCompleted:
    """One engine step's deltas (or a rejected add's terminal delta), with the engine's
    stats after it and how many `AddRequest`s the engine process had received by then."""

    deltas: list[EngineDelta]
    stats: EngineStats
    num_received: int


@dataclass(frozen=True, slots=True)
class EngineStopped:
    """The engine loop ended (stopped, or died): no more events follow."""

    stats: EngineStats
    num_received: int


Event = EngineReady | StartFailed | StepCompleted | EngineStopped
