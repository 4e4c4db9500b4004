"""The engine's error tree, shared by core bookkeeping and backends. No torch.

    EngineError                 root of everything the engine raises to its caller
    ├── RequestRejectedError    this request can never run here (permanent)
    └── EngineDeadError         the engine loop stopped; retry on another worker (retryable)

Config mistakes raise `engine.config.EngineConfigError` at start-up, sampling mistakes
`engine.sampling.SamplingParamsError` when the params are built.
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of the engine's errors as the pipeline sees them."""

    retryable = False


class RequestRejectedError(EngineError, ValueError):
    """This request can never run in this engine, e.g. its prompt is too long (permanent)."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (crashed or shut down); no request can run here.

    Retryable: the same request can run on another worker.
    """

    retryable = True
